"""``hicache_core.page_hashes``: SGLang-compatible chained page hashes, native and pure-Python paths."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import threading
from array import array
from collections.abc import Callable, Iterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_core.errors import BatchShapeError, KeyFormatError
from hicache_core.paging import hashes as _hashing
from hicache_core.paging.hashes import page_hashes

Hasher = Callable[..., list[str]]


def reference(tokens: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """SGLang's ``get_hash_str`` applied page by page: a per-token ``int.to_bytes`` loop."""
    out: list[str] = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        hasher = hashlib.sha256()
        if prior_hash:
            hasher.update(bytes.fromhex(prior_hash))
        for t in tokens[start : start + page_size]:
            hasher.update(int(t).to_bytes(4, byteorder="little", signed=False))
        prior_hash = hasher.hexdigest()
        out.append(prior_hash)
    return out


def _impls() -> list[str]:
    return ["python", "native"] if _hashing._NATIVE is not None else ["python"]


@pytest.fixture(params=_impls())
def hasher(request: pytest.FixtureRequest) -> Iterator[Hasher]:
    """``page_hashes`` bound to one implementation (pure Python, or the C extension over OpenSSL)."""
    native = _hashing._NATIVE if request.param == "native" else None
    yield lambda tokens, page_size, prior_hash=None: _hashing._page_hashes(
        tokens, page_size, prior_hash, native
    )


# ---- fixed vectors ----------------------------------------------------------------------------

KNOWN_0123 = "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe"  # sha256(le32 of 0,1,2,3)


def test_known_digest(hasher: Hasher) -> None:
    assert hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in range(4))).hexdigest() == KNOWN_0123
    assert hasher([0, 1, 2, 3], 4) == [KNOWN_0123]
    assert hasher(array("I", [0, 1, 2, 3]), 4) == [KNOWN_0123]


def test_known_chain(hasher: Hasher) -> None:
    page0 = hashlib.sha256(b"\x01\0\0\0\x02\0\0\0").hexdigest()
    page1 = hashlib.sha256(bytes.fromhex(page0) + b"\x03\0\0\0\x04\0\0\0").hexdigest()
    assert hasher([1, 2, 3, 4], 2) == [page0, page1]
    assert hasher([3, 4], 2, page0) == [page1]


@pytest.mark.parametrize("page_size", [1, 2, 7, 8, 9, 15, 16, 17, 23, 24, 31, 32, 33, 64, 100, 256])
@pytest.mark.parametrize("with_prior", [False, True])
def test_block_boundaries(hasher: Hasher, page_size: int, with_prior: bool) -> None:
    # Page sizes around the 64-byte block and 55-byte padding limits, with and without a prior.
    tokens = [(i * 2654435761) % 2**32 for i in range(3 * page_size + 1)]
    prior = hashlib.sha256(b"prior").hexdigest() if with_prior else None
    assert hasher(tokens, page_size, prior) == reference(tokens, page_size, prior)


def test_extreme_token_values(hasher: Hasher) -> None:
    tokens = [0, 2**32 - 1, 2**31, 2**31 - 1, 2**30, 2**30 - 1, 255, 256, 65535, 65536]
    assert hasher(tokens, 2) == reference(tokens, 2)
    assert hasher(array("I", tokens), 5) == reference(tokens, 5)


def test_empty_and_partial(hasher: Hasher) -> None:
    assert hasher([], 4) == []
    assert hasher(array("I"), 4) == []
    assert hasher([1, 2, 3], 4) == []  # shorter than one page
    full = hasher(list(range(8)), 4)
    assert len(full) == 2
    assert hasher(list(range(11)), 4) == full  # the trailing partial page is ignored


def test_prior_chaining_two_halves(hasher: Hasher) -> None:
    tokens = list(range(1000, 1000 + 12 * 16))
    whole = hasher(tokens, 16)
    first = hasher(tokens[: 5 * 16], 16)
    second = hasher(tokens[5 * 16 :], 16, first[-1])
    assert first + second == whole
    assert hasher(tokens[5 * 16 :], 16, first[-1].upper()) == second  # either hex case


def test_output_format(hasher: Hasher) -> None:
    hashes = hasher(list(range(64)), 8)
    assert all(isinstance(h, str) and len(h) == 64 and h == h.lower() for h in hashes)
    assert all(int(h, 16) >= 0 for h in hashes)
    assert len(set(hashes)) == len(hashes)


# ---- property tests ---------------------------------------------------------------------------

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=300)
priors = st.none() | st.binary(min_size=32, max_size=32).map(bytes.hex)


@settings(max_examples=150, deadline=None)
@given(tokens=token_lists, page_size=st.integers(1, 70), prior=priors)
def test_matches_reference(tokens: list[int], page_size: int, prior: str | None) -> None:
    expected = reference(tokens, page_size, prior)
    assert _hashing._page_hashes(tokens, page_size, prior, None) == expected
    assert _hashing._page_hashes(array("I", tokens), page_size, prior, None) == expected
    if _hashing._NATIVE is not None:
        assert _hashing._page_hashes(tokens, page_size, prior, _hashing._NATIVE) == expected
        assert _hashing._page_hashes(array("I", tokens), page_size, prior, _hashing._NATIVE) == expected
    assert page_hashes(tuple(tokens), page_size, prior) == expected


@settings(max_examples=50, deadline=None)
@given(tokens=token_lists, page_size=st.integers(1, 40), cut=st.integers(0, 10))
def test_split_anywhere_on_a_page_boundary(tokens: list[int], page_size: int, cut: int) -> None:
    k = min(cut, len(tokens) // page_size) * page_size
    head = page_hashes(tokens[:k], page_size)
    tail = page_hashes(tokens[k:], page_size, head[-1] if head else None)
    assert head + tail == page_hashes(tokens, page_size)


@pytest.mark.skipif(_hashing._NATIVE is None, reason="C extension not built")
@pytest.mark.parametrize("seed", range(4))
def test_native_and_python_agree_on_random_inputs(seed: int) -> None:
    import random

    rng = random.Random(seed)
    n = rng.choice([0, 1, 100, 5000, 70_000])  # 70k tokens crosses the GIL-release threshold
    tokens = [rng.randrange(2**32) for _ in range(n)]
    page_size = rng.choice([1, 3, 16, 64, 257])
    prior = rng.choice([None, hashlib.sha256(bytes([seed])).hexdigest()])
    native = _hashing._page_hashes(tokens, page_size, prior, _hashing._NATIVE)
    assert native == _hashing._page_hashes(array("I", tokens), page_size, prior, None)
    assert native == _hashing._page_hashes(array("I", tokens), page_size, prior, _hashing._NATIVE)


# ---- input types ------------------------------------------------------------------------------

TOKENS = [5, 0, 2**32 - 1, 151_000, 7, 2**31, 42, 1]
EXPECTED = reference(TOKENS, 2)
SMALL = [5, 0, 127, 100, 7, 1, 42, 1]  # fits every integer typecode


@pytest.mark.parametrize("typecode", ["I", "L", "Q", "q", "l"])
def test_array_wide_typecodes(hasher: Hasher, typecode: str) -> None:
    assert hasher(array(typecode, TOKENS), 2) == EXPECTED


@pytest.mark.parametrize("typecode", ["B", "b", "H", "h", "i"])
def test_array_small_typecodes(hasher: Hasher, typecode: str) -> None:
    assert hasher(array(typecode, SMALL), 2) == reference(SMALL, 2)


def test_sequences(hasher: Hasher) -> None:
    assert hasher(tuple(TOKENS), 2) == EXPECTED
    assert hasher(range(10), 5) == reference(list(range(10)), 5)
    assert hasher([True, False, 3, 4], 2) == reference([1, 0, 3, 4], 2)


def test_memoryviews(hasher: Hasher) -> None:
    assert hasher(memoryview(array("I", TOKENS)), 2) == EXPECTED
    assert hasher(memoryview(array("I", TOKENS).tobytes()).cast("I"), 2) == EXPECTED
    assert hasher(memoryview(array("I", TOKENS))[::2], 2) == reference(TOKENS[::2], 2)
    assert hasher(memoryview(array("i", SMALL)), 2) == reference(SMALL, 2)


@pytest.mark.parametrize(
    "dtype", ["uint32", "int32", "int64", "uint64", "uint16", "int8", ">u4", ">i8", "<u4"]
)
def test_numpy(hasher: Hasher, dtype: str) -> None:
    np = pytest.importorskip("numpy")
    values = TOKENS if np.dtype(dtype).itemsize >= 4 and np.iinfo(dtype).max >= 2**32 - 1 else SMALL
    arr = np.array(values, dtype=dtype)
    assert hasher(arr, 2) == reference(values, 2)
    assert hasher(arr[::2], 2) == reference(values[::2], 2)  # non-contiguous


@pytest.mark.parametrize("dtype", ["int32", "int64", "int16", "uint8"])
def test_torch(hasher: Hasher, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    values = [5, 0, 2**31 - 1, 151_000, 7, 9, 42, 1] if dtype in ("int32", "int64") else SMALL
    if dtype == "int64":
        values = TOKENS
    t = torch.tensor(values, dtype=getattr(torch, dtype))
    assert hasher(t, 2) == reference(values, 2)
    assert hasher(t[::2], 2) == reference(values[::2], 2)  # non-contiguous


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [0, -1, -64, True, 2.0, "64", None])
def test_bad_page_size(hasher: Hasher, page_size: object) -> None:
    with pytest.raises(BatchShapeError, match="page_size"):
        hasher([1, 2, 3, 4], page_size)


@pytest.mark.parametrize(
    "prior",
    ["", "abc", "0" * 63, "0" * 65, "g" * 64, " " + "0" * 63, "0" * 62 + " 0", b"\0" * 32, 123],
)
def test_bad_prior_hash(hasher: Hasher, prior: object) -> None:
    with pytest.raises(KeyFormatError, match="prior_hash"):
        hasher([1, 2], 2, prior)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64, -(2**40)])
def test_out_of_range_ids_in_sequences(hasher: Hasher, bad: int) -> None:
    with pytest.raises(BatchShapeError, match=r"token_ids\[2\].*outside \[0, 2\*\*32\)"):
        hasher([1, 2, bad, 4], 2)
    with pytest.raises(BatchShapeError, match=r"outside \[0, 2\*\*32\)"):
        hasher([1, 2, 3, 4, bad], 2)  # even in the ignored trailing partial page


def test_out_of_range_ids_in_arrays(hasher: Hasher) -> None:
    with pytest.raises(BatchShapeError, match=r"token_ids\[1\] = -7"):
        hasher(array("i", [1, -7, 3, 4]), 2)
    with pytest.raises(BatchShapeError, match="outside"):
        hasher(array("q", [1, 2, 3, 2**32]), 2)
    with pytest.raises(BatchShapeError, match=r"token_ids\[2\] = -1"):
        hasher(memoryview(array("i", [1, 2, -1])), 1)


def test_out_of_range_ids_numpy_torch(hasher: Hasher) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    for bad in (
        np.array([1, -5, 3, 4], dtype=np.int32),
        np.array([1, -5, 3, 4], dtype=np.int64),
        np.array([1, 2**32, 3, 4], dtype=np.uint64),
        torch.tensor([1, -5, 3, 4], dtype=torch.int32),
        torch.tensor([1, 2**32, 3, 4], dtype=torch.int64),
        torch.tensor([1, -1, 3, 4], dtype=torch.int8),
    ):
        with pytest.raises(BatchShapeError, match=r"token_ids\[1\] = .*outside"):
            hasher(bad, 2)


@pytest.mark.parametrize("blob", [b"\x01\0\0\0", bytearray(8), "1234", memoryview(b"abcd")])
def test_bytes_like_is_not_a_token_list(hasher: Hasher, blob: object) -> None:
    with pytest.raises(BatchShapeError, match="not a token list"):
        hasher(blob, 1)


def test_not_one_dimensional(hasher: Hasher) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    for bad in (
        [[1, 2], [3, 4]],
        [1, (2,), 3],
        np.zeros((2, 2), dtype=np.uint32),
        np.uint32(3),
        np.array(3, dtype=np.uint32),
        torch.zeros((2, 2), dtype=torch.int32),
        torch.tensor(3, dtype=torch.int32),
        memoryview(array("I", [1, 2, 3, 4])).cast("B").cast("I", (2, 2)),
        5,
        {1, 2},
        None,
    ):
        with pytest.raises(BatchShapeError, match=r"1-D|flat|sequence"):
            hasher(bad, 1)


def test_non_integer_dtypes(hasher: Hasher) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    for bad in (
        [1.0, 2.0],
        ["1", "2"],
        array("d", [1.0, 2.0]),
        np.array([1.0, 2.0]),
        np.array([True, False]),
        torch.tensor([1.0, 2.0]),
        torch.tensor([True, False]),
    ):
        with pytest.raises(BatchShapeError):
            hasher(bad, 1)


def test_non_cpu_tensor(hasher: Hasher) -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(BatchShapeError, match=r"CPU.*\.cpu\(\)"):
        hasher(torch.empty(4, dtype=torch.int32, device="meta"), 2)


def test_errors_are_value_errors() -> None:
    # Callers that do not know hicache still catch the natural builtin.
    with pytest.raises(ValueError):
        page_hashes([-1], 1)
    with pytest.raises(ValueError):
        page_hashes([1], 1, prior_hash="zz")


@pytest.mark.skipif(_hashing._NATIVE is None, reason="C extension not built")
def test_native_list_mutated_by_index_does_not_crash() -> None:
    tokens: list[object] = list(range(8))

    class Evil:
        def __index__(self) -> int:
            tokens.clear()
            return 1

    tokens[3] = Evil()
    with pytest.raises(BatchShapeError, match="changed size"):
        _hashing._page_hashes(tokens, 2, None, _hashing._NATIVE)


# ---- backend selection, threads, import cost --------------------------------------------------


def _run_python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_backend_env_var_forces_python() -> None:
    code = "import hicache_core.paging.hashes as h; print(h.BACKEND)"
    assert _run_python(code, HICACHE_PURE_PYTHON_HASH="1") == "python"
    built = importlib.util.find_spec("hicache_core.native._pagehash") is not None
    assert _run_python(code, HICACHE_PURE_PYTHON_HASH="0") == ("native" if built else "python")
    assert _hashing.BACKEND == ("native" if _hashing._NATIVE is not None else "python")


def test_import_does_not_load_torch_or_numpy() -> None:
    code = "import sys, hicache_core.paging.hashes; print('torch' in sys.modules, 'numpy' in sys.modules)"
    assert _run_python(code) == "False False"


def test_concurrent_threads(hasher: Hasher) -> None:
    tokens = array("I", range(200_000))
    expected = hasher(tokens, 64)
    results: list[list[str]] = []
    threads = [threading.Thread(target=lambda: results.append(hasher(tokens, 64))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 4
