"""``hicache_core.native._pagehash`` against its pure-Python twin, on random and hostile inputs.

Every input must give the same hashes from both implementations, or make both raise the same
exception type: a hicache error for bad arguments, or the very exception a hostile object's own
method raised. Hostile objects (items whose ``__index__`` mutates the list being hashed, lists
whose ``__len__`` lies, ...) keep state, so each implementation gets a freshly built copy.
The C module is also called directly with arguments its Python wrapper never passes: it must
return well-formed hashes or raise, never crash.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache_core.native as _native_pkg
from hicache_core.errors import BatchShapeError, BatchTypeError, HiCacheError, KeyFormatError, KeyTypeError
from hicache_core.paging import hashes as _hashing

NATIVE = _hashing._NATIVE
pytestmark = [
    pytest.mark.skipif(
        NATIVE is None,
        reason="the C extension hicache_core.native._pagehash is not built (no C compiler or OpenSSL "
        "headers at install time) or HICACHE_PURE_PYTHON_HASH is set",
    ),
    # An __index__ returning an int subclass is deprecated; both implementations warn alike.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

U32 = 2**32
Outcome = tuple[str, Any]  # ("ok", hashes) or ("raised", exception type)


class HostileError(Exception):
    """Raised by hostile objects: must reach the caller unchanged from both implementations."""


def reference(words: Sequence[int], page_size: int, prior: bytes | None) -> list[str]:
    """Chained per-page sha256 straight from the definition."""
    out: list[str] = []
    prev = prior or b""
    for start in range(0, len(words) - len(words) % page_size, page_size):
        prev = hashlib.sha256(
            prev + b"".join(w.to_bytes(4, "little") for w in words[start : start + page_size])
        ).digest()
        out.append(prev.hex())
    return out


def outcome(make: Callable[[], tuple[object, object, object]], native: bool) -> Outcome:
    tokens, page_size, prior = make()
    try:
        return "ok", _hashing._page_hashes(tokens, page_size, prior, NATIVE if native else None)  # type: ignore[arg-type]
    except Exception as exc:
        return "raised", type(exc)


def assert_twins(make: Callable[[], tuple[object, object, object]]) -> Outcome:
    """Run both implementations on fresh copies of one input; they must agree. Returns the outcome."""
    python, native = outcome(make, native=False), outcome(make, native=True)
    assert native == python
    if native[0] == "raised":
        assert issubclass(native[1], (HiCacheError, HostileError)), native[1]
    return native


# ---- hostile objects ------------------------------------------------------------------------------


class Holder:
    """Gives a hostile item access to the list it sits in (set once the list is built)."""

    target: list[object] | None = None


@dataclass(frozen=True)
class Item:
    """The recipe of one token: ``kind`` and its arguments; :meth:`make` builds a fresh object."""

    kind: str
    value: int = 0
    arg: int = 0

    def make(self, holder: Holder) -> object:
        kind, value, arg = self.kind, self.value, self.arg
        if kind == "int":
            return value
        if kind == "bool":
            return bool(value & 1)
        if kind == "intsub":  # both read the int's value; its overridden methods must never run
            return _EvilInt(value)
        if kind == "not-int":
            return [1.5, "7", None, b"\x01", [value], (value,)][arg % 6]
        if kind == "bad-bool":
            return _BadBool(value)
        return _Indexable(kind, value, arg, holder)


class _EvilInt(int):
    def __index__(self) -> int:
        raise HostileError("int subclass __index__ called")

    def __int__(self) -> int:
        raise HostileError("int subclass __int__ called")

    def __repr__(self) -> str:
        raise HostileError("int subclass __repr__ called")

    __str__ = __repr__


class _BadBool:
    """Truthiness raises; __index__ works."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __bool__(self) -> bool:
        raise HostileError("__bool__ called")

    def __index__(self) -> int:
        return self.value


class _Indexable:
    """An object whose __index__ changes value, raises, returns junk or mutates the list."""

    RAISES = (TypeError, ValueError, OverflowError, IndexError, HostileError)

    def __init__(self, kind: str, value: int, arg: int, holder: Holder) -> None:
        self.kind, self.value, self.arg, self.holder, self.calls = kind, value, arg, holder, 0

    def __index__(self) -> Any:
        self.calls += 1
        kind, value, arg = self.kind, self.value, self.arg
        target = self.holder.target
        if kind == "changing":  # a different value on every call
            return value + (self.calls - 1) * arg
        if kind == "raises":
            raise self.RAISES[arg % len(self.RAISES)](f"__index__ call {self.calls}")
        if kind == "junk":
            return [1.5, "3", None, _EvilInt(value)][arg % 4]
        if target is not None:
            if kind == "clear":
                target.clear()
            elif kind == "shrink":
                del target[-(arg % 5 + 1) :]
            elif kind == "grow":
                target.extend(range(arg % 5 + 1))
            elif kind == "shrink-grow":  # same length afterwards, different items
                del target[-1:]
                target.append(value)
            elif kind == "replace" and list.__len__(target):  # the real length: a LyingList lies
                target[arg % list.__len__(target)] = value
        return value


_ITEM_KINDS = ["changing", "raises", "junk", "clear", "shrink", "grow", "shrink-grow", "replace"]
valid_ints = st.integers(0, U32 - 1)
any_ints = st.one_of(
    valid_ints, st.integers(-(2**70), 2**70), st.sampled_from([-1, U32, 2**63, 2**64, -(2**63) - 1, 10**400])
)
items = st.one_of(
    st.builds(Item, st.just("int"), valid_ints),
    st.builds(Item, st.just("int"), any_ints),
    st.builds(Item, st.just("bool"), st.integers(0, 1)),
    st.builds(Item, st.just("intsub"), any_ints),
    st.builds(Item, st.just("not-int"), valid_ints, st.integers(0, 5)),
    st.builds(Item, st.just("bad-bool"), valid_ints),
    st.builds(Item, st.sampled_from(_ITEM_KINDS), any_ints, st.integers(0, 2**40)),
)


class LyingList(list):  # type: ignore[type-arg]
    """A list whose __len__ answers differently on every call."""

    def __init__(self, values: list[object], lies: list[int]) -> None:
        super().__init__(values)
        self.lies, self.calls = lies, 0

    def __len__(self) -> int:
        self.calls += 1
        return max(0, super().__len__() + self.lies[self.calls % len(self.lies)])


class ShiftySequence(Sequence[object]):
    """A Sequence whose length changes while it is read; __getitem__ honours the real data."""

    def __init__(self, values: list[object], lies: list[int]) -> None:
        self.values, self.lies, self.calls = values, lies, 0

    def __len__(self) -> int:
        self.calls += 1
        return max(0, len(self.values) + self.lies[self.calls % len(self.lies)])

    def __getitem__(self, i: Any) -> Any:
        return self.values[i]


def build_tokens(container: str, recipe: list[Item], lies: list[int]) -> object:
    holder = Holder()
    values = [item.make(holder) for item in recipe]
    built: object
    if container == "list":
        built = holder.target = values
    elif container == "tuple":
        built = tuple(values)
    elif container == "lying-list":
        built = holder.target = LyingList(values, lies)
    else:
        built = ShiftySequence(values, lies)
        holder.target = values
    return built


# ---- page sizes and priors ------------------------------------------------------------------------


class _IndexOnly:
    def __init__(self, value: int) -> None:
        self.value, self.calls = value, 0

    def __index__(self) -> int:
        self.calls += 1
        if self.calls > 1:  # a second read would see another value
            return self.value + 1
        return self.value


hostile_page_sizes = st.one_of(
    st.sampled_from([0, -1, -64, True, False, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]),
    st.sampled_from([1.0, "4", None, b"4", [4]]),
    st.integers(1, 9).map(_IndexOnly),
    st.integers(-3, 0).map(_IndexOnly),
)


class _LyingStr(str):
    def __len__(self) -> int:
        return 64


hostile_priors = st.one_of(
    st.sampled_from(["", "0" * 63, "0" * 65, "g" * 64, " " + "0" * 63, "0" * 62 + "\n0", "é" * 64, 123]),
    st.binary(min_size=0, max_size=40),
    st.binary(min_size=32, max_size=32).map(lambda b: _LyingStr(b.hex()[:10])),
    st.binary(min_size=32, max_size=32).map(bytearray),
)
good_priors = (
    st.none()
    | st.binary(min_size=32, max_size=32).map(bytes.hex)
    | st.binary(min_size=32, max_size=32).map(lambda b: b.hex().upper())
)


# ---- random well-formed inputs ----------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    words=st.lists(valid_ints, max_size=400),
    page_size=st.integers(1, 80),
    prior=good_priors,
    form=st.sampled_from(["list", "tuple", "array-I", "array-L", "array-Q", "memoryview", "cast", "range"]),
)
def test_random_valid_inputs(words: list[int], page_size: int, prior: str | None, form: str) -> None:
    def make() -> tuple[object, object, object]:
        makers: dict[str, Callable[[], object]] = {
            "list": lambda: list(words),
            "tuple": lambda: tuple(words),
            "array-I": lambda: array("I", words),
            "array-L": lambda: array("L", words),
            "array-Q": lambda: array("Q", words),
            "memoryview": lambda: memoryview(array("I", words)),
            "cast": lambda: memoryview(array("I", words).tobytes()).cast("I"),
            "range": lambda: range(len(words)),
        }
        return makers[form](), page_size, prior

    result = assert_twins(make)
    values = list(range(len(words))) if form == "range" else words
    assert result == ("ok", reference(values, page_size, bytes.fromhex(prior) if prior else None))


@pytest.mark.parametrize("page_size", [1, 15, 16, 17, 511, 512, 513, 1000])
@pytest.mark.parametrize("n_words", [1100, 17_000])  # 17k words (68 KB) are hashed without the GIL
@pytest.mark.parametrize("prior", [None, hashlib.sha256(b"prior").hexdigest()])
def test_page_sizes_around_the_scratch_buffer(page_size: int, n_words: int, prior: str | None) -> None:
    """Pages of up to 512 words are copied behind the previous digest and hashed with one
    SHA256_Update; larger ones take two. Both must match the definition."""
    words = [(i * 2654435761 + page_size) % U32 for i in range(n_words)]
    expected = reference(words, page_size, bytes.fromhex(prior) if prior else None)
    assert assert_twins(lambda: (list(words), page_size, prior)) == ("ok", expected)
    assert assert_twins(lambda: (array("I", words), page_size, prior)) == ("ok", expected)


@pytest.mark.parametrize("n_words", [16_383, 16_384, 40_000])  # across one and several 64 KiB hand-overs
@pytest.mark.parametrize("page_size", [1, 64, 600, 20_000])
def test_across_the_gil_hand_overs(n_words: int, page_size: int) -> None:
    """Pages are hashed with the GIL held, each page's str made while the next page is hashed,
    and the GIL is handed over after every 64 KiB of input (every page when a page is larger).
    Same hashes on both sides of each hand-over, and an int32 buffer's negative last word is
    refused."""
    words = [(i * 2654435761) % 2**31 for i in range(n_words)]
    prior = hashlib.sha256(b"prior").hexdigest()
    expected = reference(words, page_size, bytes.fromhex(prior))
    assert assert_twins(lambda: (array("I", words), page_size, prior)) == ("ok", expected)
    assert assert_twins(lambda: (list(words), page_size, prior)) == ("ok", expected)
    negative = array("i", [*words[:-1], -1])
    assert assert_twins(lambda: (negative, page_size, prior)) == ("raised", BatchShapeError)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(-(2**40), 2**40), max_size=200),
    page_size=st.integers(1, 40),
    typecode=st.sampled_from("bBhHiIlLqQ"),
)
def test_random_arrays_of_every_integer_typecode(values: list[int], page_size: int, typecode: str) -> None:
    bits = 8 * array(typecode).itemsize
    lo, hi = (0, 2**bits) if typecode.isupper() else (-(2 ** (bits - 1)), 2 ** (bits - 1))
    fitting = [v for v in values if lo <= v < hi]
    assert_twins(lambda: (array(typecode, fitting), page_size, None))
    assert_twins(lambda: (memoryview(array(typecode, fitting)), page_size, None))
    assert_twins(lambda: (memoryview(array(typecode, fitting))[::2], page_size, None))


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.integers(-(2**33), 2**33), max_size=200),
    page_size=st.integers(1, 40),
    dtype=st.sampled_from(
        ["uint32", "int32", "<u4", ">u4", "<i4", "int64", "uint64", "uint16", "int8", ">i8"]
    ),
    step=st.sampled_from([1, 1, 2, -1]),
)
def test_random_numpy_arrays(values: list[int], page_size: int, dtype: str, step: int) -> None:
    np = pytest.importorskip("numpy")
    info = np.iinfo(dtype)
    fitting = [v for v in values if info.min <= v <= info.max]
    assert_twins(lambda: (np.array(fitting, dtype=dtype)[::step], page_size, None))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(st.integers(-(2**33), 2**33), max_size=100),
    page_size=st.integers(1, 20),
    dtype=st.sampled_from(["int32", "int64", "int16", "uint8", "int8"]),
    step=st.sampled_from([1, 2]),
)
def test_random_torch_tensors(values: list[int], page_size: int, dtype: str, step: int) -> None:
    torch = pytest.importorskip("torch")
    info = torch.iinfo(getattr(torch, dtype))
    fitting = [v for v in values if info.min <= v <= info.max]
    assert_twins(lambda: (torch.tensor(fitting, dtype=getattr(torch, dtype))[::step], page_size, None))


@pytest.mark.parametrize(
    "blob",
    [b"\x01\0\0\0", bytearray(8), memoryview(b"abcdefgh"), memoryview(bytearray(8)).cast("c"), "1234"],
)
def test_bytes_like_inputs_are_rejected_alike(blob: object) -> None:
    assert assert_twins(lambda: (blob, 1, None)) == ("raised", BatchTypeError)


# ---- hostile inputs -------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    recipe=st.lists(items, max_size=40),
    container=st.sampled_from(["list", "list", "tuple", "lying-list", "shifty"]),
    lies=st.lists(st.integers(-5, 5), min_size=1, max_size=4),
    page_size=st.integers(1, 9),
    prior=good_priors,
)
def test_hostile_tokens(
    recipe: list[Item], container: str, lies: list[int], page_size: int, prior: str | None
) -> None:
    assert_twins(lambda: (build_tokens(container, recipe, lies), page_size, prior))


@settings(max_examples=200, deadline=None)
@given(words=st.lists(valid_ints, max_size=40), page_size=hostile_page_sizes, prior=good_priors)
def test_hostile_page_sizes(words: list[int], page_size: object, prior: str | None) -> None:
    # _IndexOnly keeps state: rebuild it for each implementation.
    def make() -> tuple[object, object, object]:
        size = _IndexOnly(page_size.value) if isinstance(page_size, _IndexOnly) else page_size
        return list(words), size, prior

    result = assert_twins(make)
    if isinstance(page_size, bool) or not isinstance(page_size, (int, _IndexOnly)):
        assert result == ("raised", BatchTypeError)


@settings(max_examples=150, deadline=None)
@given(words=st.lists(valid_ints, max_size=40), page_size=st.integers(1, 9), prior=hostile_priors)
def test_hostile_priors(words: list[int], page_size: int, prior: object) -> None:
    expected = KeyFormatError if isinstance(prior, str) else KeyTypeError
    assert assert_twins(lambda: (array("I", words), page_size, prior)) == ("raised", expected)
    assert assert_twins(lambda: (list(words), page_size, prior)) == ("raised", expected)


def test_item_shrinking_the_list_is_reported_by_both() -> None:
    def make() -> tuple[object, object, object]:
        holder = Holder()
        tokens = [*range(8), Item("clear").make(holder), *range(8)]
        holder.target = tokens
        return tokens, 4, None

    assert assert_twins(make) == ("raised", BatchShapeError)


def test_int_subclass_methods_are_never_called() -> None:
    tokens = [_EvilInt(v) for v in (1, 2, 3, 2**32 - 1)]
    assert assert_twins(lambda: (list(tokens), 2, None)) == ("ok", reference([1, 2, 3, 2**32 - 1], 2, None))
    assert assert_twins(lambda: ([1, _EvilInt(2**32)], 2, None)) == ("raised", BatchShapeError)
    assert assert_twins(lambda: ([1, _EvilInt(-5)], 2, None)) == ("raised", BatchShapeError)


def test_huge_values_are_described_not_printed() -> None:
    # 10**5000 exceeds the int-to-str digit limit: the error message must not try to print it.
    for bad in (10**5000, -(10**5000)):

        def make(bad: int = bad) -> tuple[object, object, object]:
            return [1, bad], 1, None

        assert assert_twins(make) == ("raised", BatchShapeError)

    class Huge:
        def __index__(self) -> int:
            return 10**5000

    assert assert_twins(lambda: ([1, Huge()], 1, None)) == ("raised", BatchShapeError)


class _Mutator:
    """An item whose ``__index__`` first changes the list it sits in, then returns ``value``."""

    def __init__(self, value: int, change: Callable[[list[object]], None], holder: Holder) -> None:
        self.value, self.change, self.holder = value, change, holder

    def __index__(self) -> int:
        assert self.holder.target is not None
        self.change(self.holder.target)
        return self.value


def _with_mutator(n: int, at: int, change: Callable[[list[object]], None]) -> tuple[object, object, object]:
    """range(n) as a list whose item ``at`` (value ``at``) runs ``change`` on the list when read."""
    holder = Holder()
    tokens: list[object] = list(range(n))
    tokens[at] = _Mutator(at, change, holder)
    holder.target = tokens
    return tokens, 4, None


def test_items_changed_by_index_are_read_after_the_change() -> None:
    # The C loop reads the list's length and its items again after any __index__ call.
    def replace(t: list[object]) -> None:
        t[12] = 777

    def swap_tail(t: list[object]) -> None:  # same length afterwards, new items
        del t[8:]
        t.extend([900] * 8)

    def drop_self(t: list[object]) -> None:  # the list held the item's last reference
        t[3] = 3

    words = list(range(16))
    assert assert_twins(lambda: _with_mutator(16, 3, replace)) == (
        "ok",
        reference([*words[:12], 777, *words[13:]], 4, None),
    )
    assert assert_twins(lambda: _with_mutator(16, 3, swap_tail)) == (
        "ok",
        reference([*words[:8], *[900] * 8], 4, None),
    )
    assert assert_twins(lambda: _with_mutator(16, 3, drop_self)) == ("ok", reference(words, 4, None))


def test_list_shrunk_below_the_next_index_is_an_error() -> None:
    def shrink(t: list[object]) -> None:
        del t[2:]

    def shrink_to_here(t: list[object]) -> None:
        del t[6:]

    assert assert_twins(lambda: _with_mutator(16, 5, shrink)) == ("raised", BatchShapeError)
    assert assert_twins(lambda: _with_mutator(16, 5, shrink_to_here)) == ("raised", BatchShapeError)
    assert assert_twins(lambda: _with_mutator(16, 15, shrink)) == ("raised", BatchShapeError)


def test_c_source_uses_only_the_public_api() -> None:
    """No private ``_Py`` names and no struct fields of Python objects in the C file (outside
    comments); documented macros such as ``PyList_GET_ITEM`` are public API."""
    source = (Path(_native_pkg.__file__).parent / "_pagehash.c").read_text()
    code = re.sub(r"/\*.*?\*/|//[^\n]*", " ", source, flags=re.S)
    assert "PyList_GET_ITEM" in code  # the check below reads the code, not the comments
    assert re.findall(r"\b_Py\w*", code) == []
    assert re.findall(r"(?:->|\.)\s*(?:ob|tp)_\w+", code) == []


# ---- the C module called directly -------------------------------------------------------------------


def _direct(tokens: object, page_size: object, prior: object, check_sign: object) -> list[str] | None:
    """Call the C function; None if it raised. A result must be well formed."""
    assert NATIVE is not None
    try:
        result = NATIVE.page_hashes(tokens, page_size, prior, check_sign)  # type: ignore[arg-type]
    except Exception:
        return None
    assert isinstance(result, list)
    assert all(isinstance(h, str) and len(h) == 64 and int(h, 16) >= 0 and h == h.lower() for h in result)
    return result


def _buffers(words: list[int]) -> Iterator[tuple[object, list[int] | None]]:
    """Buffers of many formats, with the words the native function should hash (None: must raise)."""
    raw = array("I", words).tobytes()
    yield array("I", words), words
    yield memoryview(raw).cast("I"), words
    yield raw, words  # format B: raw little-endian words
    yield raw + b"\0", None  # not a whole number of words
    yield memoryview(raw).cast("B").cast("f") if raw else memoryview(raw), None if raw else []
    yield array("d", [float(w) for w in words]), None
    yield array("Q", words), None
    strided = memoryview(array("I", words))[::2]
    yield strided, words[::2] if strided.c_contiguous else None
    if len(words) % 2 == 0 and words:
        yield memoryview(raw).cast("I", (2, len(words) // 2)), None


@settings(max_examples=200, deadline=None)
@given(
    words=st.lists(valid_ints, max_size=60),
    page_size=st.one_of(st.integers(-3, 20), st.sampled_from([2**61, 2**63 - 1, 2**63, -(2**63)])),
    prior=st.one_of(st.none(), st.binary(min_size=0, max_size=40), st.text(max_size=3)),
    check_sign=st.one_of(st.booleans(), st.integers(-2, 2), st.just(_BadBool(1))),
)
def test_direct_calls_never_crash(
    words: list[int], page_size: object, prior: object, check_sign: object
) -> None:
    valid_args = (
        isinstance(page_size, int)
        and 0 < page_size < 2**63
        and (prior is None or (isinstance(prior, bytes) and len(prior) == 32))
        and not isinstance(check_sign, _BadBool)
    )
    negative = bool(check_sign) if not isinstance(check_sign, _BadBool) else False
    for tokens, expected_words in _buffers(words):
        result = _direct(tokens, page_size, prior, check_sign)
        if not valid_args or expected_words is None:
            assert result is None
            continue
        assert isinstance(page_size, int)
        signed = negative or getattr(tokens, "typecode", None) in ("i", "l")
        signed_bad = signed and any(w >= 2**31 for w in expected_words)
        if signed_bad:
            assert result is None
        else:
            assert result == reference(expected_words, page_size, prior if isinstance(prior, bytes) else None)
    result = _direct(list(words), page_size, prior, check_sign)
    if valid_args:
        assert isinstance(page_size, int)
        assert result == reference(words, page_size, prior if isinstance(prior, bytes) else None)


@pytest.mark.parametrize("tokens", [None, 5, {1: 2}, {1, 2}, object(), iter([1, 2])])
def test_direct_calls_reject_non_buffers(tokens: object) -> None:
    assert _direct(tokens, 1, None, False) is None


def test_direct_call_with_signed_words() -> None:
    words = array("i", [1, -2, 3, 4])
    assert _direct(words, 2, None, False) is None  # format i: always sign-checked
    assert _direct(words.tobytes(), 2, None, True) is None
    unsigned = [1, 2**32 - 2, 3, 4]
    assert _direct(words.tobytes(), 2, None, False) == reference(unsigned, 2, None)
