"""The C batch I/O path (``native_io``) against the pure-Python one: same files, same answers.

Faults here are real (a file squatting on a shard directory, a directory squatting on a page,
bytes flipped on disk), so they reach the C extension's syscalls; ``test_file_errors.py``
patches ``os`` functions and therefore pins ``native_io: False``.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from file_helpers import config, files_under, fill, pages, temp_files, zero
from hicache_file import _native_io

from hicache_core import CacheController, IoOp, MHAKVPool, MLAKVPool, open_store, page_hashes

ENGINES = {"native": {"native_io": True}, "python": {"native_io": False}}
REQUIRED = os.environ.get("HICACHE_REQUIRE_NATIVE", "") not in ("", "0")

needs_native = pytest.mark.skipif(
    not _native_io.available() and not REQUIRED, reason="hicache_file._fastio was not built"
)


@needs_native
def test_native_engine_is_used_by_default(tmp_path: Path) -> None:
    assert _native_io.available(), "HICACHE_REQUIRE_NATIVE is set but hicache_file._fastio is missing"
    with open_store(config(tmp_path)) as store:
        assert store.backend.io_engine == "native"
    with open_store(config(tmp_path, options={"native_io": False})) as store:
        assert store.backend.io_engine == "python"
    with open_store(config(tmp_path, options={"publish": "rename"})) as store:
        assert store.backend.io_engine == "python"  # the C path publishes with O_TMPFILE only
    with open_store(config(tmp_path, options={"fsync": True})) as store:
        assert store.backend.io_engine == "python"


@needs_native
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize(("writer", "reader"), [("native", "python"), ("python", "native")])
def test_engines_read_each_others_pages(tmp_path: Path, layout: str, writer: str, reader: str) -> None:
    n = 24
    kv = MHAKVPool(n, 4, 3, 2, 8, layout=layout)
    fill(kv, 7)
    want = pages(kv, range(n))
    hashes = page_hashes(list(range(4 * n)), 4)
    with CacheController(
        config(
            tmp_path, layout=layout, options={**ENGINES[writer], "io_threads": 3, "parallel_min_bytes": 0}
        ),
        kv,
    ) as ctl:
        res = ctl.backup(hashes, range(n))
        assert res.ok and res.pages == n and res.skipped == 0
    written = files_under(tmp_path)
    zero(kv)
    with CacheController(
        config(
            tmp_path, layout=layout, options={**ENGINES[reader], "io_threads": 3, "parallel_min_bytes": 0}
        ),
        kv,
    ) as ctl:
        assert ctl.prefetch(hashes, range(n)).pages == n
        assert pages(kv, range(n)) == want
        again = ctl.backup(hashes, range(n))  # set skips stored pages itself (set_skips_existing)
        assert again.ok and again.skipped == 0
        assert ctl.store.backend.stats.writes == 0
        assert ctl.store.backend.stats.skipped_writes == 2 * n
    assert files_under(tmp_path) == written


@needs_native
@pytest.mark.parametrize("engine", ENGINES)
def test_set_skips_present_keys_and_keeps_them(tmp_path: Path, engine: str) -> None:
    first, second = torch.full((300,), 1, dtype=torch.uint8), torch.full((300,), 2, dtype=torch.uint8)
    with open_store(config(tmp_path, options=ENGINES[engine])) as store:
        assert store.batch_io_v1(IoOp.SET, ["s.a"], [first]) == [True]
        assert store.batch_io_v1(IoOp.SET, ["s.a", "s.b"], [second, second]) == [True, True]
        out = [torch.zeros(300, dtype=torch.uint8) for _ in range(2)]
        assert store.batch_io_v1(IoOp.GET, ["s.a", "s.b"], out) == [True, True]
        assert torch.equal(out[0], first) and torch.equal(out[1], second)
        st = store.backend.stats
        assert (st.writes, st.skipped_writes) == (2, 1)


@needs_native
@pytest.mark.parametrize("engine", ENGINES)
def test_shard_that_is_a_file_fails_only_its_pages(tmp_path: Path, engine: str) -> None:
    """A regular file where a shard directory should be: ENOTDIR for its keys, nothing left behind."""
    data = [torch.full((500,), i, dtype=torch.uint8) for i in range(3)]
    with open_store(config(tmp_path, options=ENGINES[engine])) as store:
        backend = store.backend
        bad = os.path.dirname(backend.path_of("x.key-abc"))
        os.makedirs(os.path.dirname(bad), exist_ok=True)
        Path(bad).write_bytes(b"not a directory")
        res = store.batch_io_v1(IoOp.SET, ["x.key-abc", "x.key-abd", "x.other-abc"], data)
        assert res == [False, True, False]
        assert backend.stats.write_errors == 2 and backend.stats.writes == 1
        assert not temp_files(tmp_path)
        assert store.batch_io_v1(IoOp.EXISTS, ["x.key-abc", "x.key-abd"]) == [False, True]


@needs_native
@pytest.mark.parametrize("engine", ENGINES)
def test_page_that_is_a_directory_is_a_read_error(tmp_path: Path, engine: str) -> None:
    with open_store(config(tmp_path, options=ENGINES[engine])) as store:
        backend = store.backend
        good = torch.arange(64, dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.SET, ["d.good"], [good]) == [True]
        os.makedirs(backend.path_of("d.dir"))
        out = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
        assert store.batch_io_v1(IoOp.GET, ["d.dir", "d.good"], out) == [False, True]
        assert torch.equal(out[1], good)
        assert backend.stats.read_errors == 1 and backend.stats.integrity_errors == 0


@needs_native
@pytest.mark.parametrize("c_checksums", [True, False], ids=["c-checksums", "python-checksums"])
@pytest.mark.parametrize("engine", ENGINES)
def test_corrupt_and_resized_pages(
    tmp_path: Path, engine: str, c_checksums: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flipped byte is quarantined; a valid page of another size is a plain miss."""
    if c_checksums and not _native_io.checksums_in_c():
        pytest.skip("_fastio found no XXH3 in python-xxhash: reads checksum in Python")
    if not c_checksums:
        monkeypatch.setattr(_native_io, "checksums_in_c", lambda: False)
    kv = MLAKVPool(4, 4, 2, 16)
    fill(kv, 3)
    hashes = page_hashes(list(range(16)), 4)
    with CacheController(config(tmp_path, is_mla_model=True, options=ENGINES[engine]), kv) as ctl:
        assert ctl.backup(hashes, range(4)).ok
        backend = ctl.store.backend
        keys = [ks[0] for ks in ctl.store.page_keys("kv", hashes)]
        path = backend.path_of(keys[1])
        raw = bytearray(Path(path).read_bytes())
        raw[-5] ^= 0xFF
        Path(path).write_bytes(raw)
        zero(kv)
        res = ctl.prefetch(hashes, range(4))
        assert res.pages == 1 and backend.stats.integrity_errors == 1
        assert not os.path.exists(path), "a corrupt page is removed so the next backup rewrites it"
        small = torch.zeros(8, dtype=torch.uint8)
        assert ctl.store.batch_io_v1(IoOp.GET, [keys[0]], [small]) == [False]
        assert backend.stats.size_mismatches == 1 and backend.stats.integrity_errors == 1


@needs_native
def test_fastio_rejects_malformed_items(tmp_path: Path) -> None:
    fastio = _native_io._fastio
    assert fastio is not None
    with pytest.raises(ValueError):
        fastio.read_batch([("p",)])
    with pytest.raises(ValueError):
        fastio.read_batch([(str(tmp_path / "p"), [])])
    with pytest.raises(TypeError):
        fastio.read_batch([(b"bytes-path", [bytearray(1)])])
    with pytest.raises(TypeError):
        fastio.read_batch([(str(tmp_path / "p"), [object()])])
    with pytest.raises(BufferError):
        fastio.read_batch([(str(tmp_path / "p"), [b"read-only"])])
    with pytest.raises(TypeError):
        fastio.publish_batch([(str(tmp_path), str(tmp_path / "p"), "not a list", True)])
    assert fastio.read_batch([]) == [] and fastio.publish_batch([]) == []
    assert fastio.read_batch([(str(tmp_path / "missing"), [bytearray(4)])]) == [-2]


@needs_native
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="checked where CI runs")
def test_c_checksums_are_active() -> None:
    """A silent fall-back to Python checksums (GIL-bound, 10-25 % slower I/O) fails here."""
    assert _native_io.checksums_in_c(), (
        "hicache_file._fastio found no XXH3 in python-xxhash's extension module (were its "
        "symbols hidden or renamed?); file I/O now checksums in Python under the GIL"
    )


@needs_native
def test_c_read_verification_matches_the_format(tmp_path: Path) -> None:
    """``read_verify_pages`` accepts exactly the pages ``_format`` writes, whatever the payload
    split, and hands every kind of damage back to Python (code 1) without touching the rest."""
    from hicache_file import _format as fmt

    fastio = _native_io._fastio
    assert fastio is not None
    if not fastio.HAVE_XXH3:
        pytest.skip("_fastio found no XXH3 in python-xxhash: reads verify in Python")
    gen = torch.Generator().manual_seed(7)

    def page(name: str, sizes: list[int], damage: Callable[[bytearray], None] | None = None) -> tuple:
        payload = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=gen).numpy().tobytes()
        key = name.encode()
        data = bytearray(fmt.encode_header(key, len(payload), fmt.checksum([payload])) + payload)
        if damage is not None:
            damage(data)
        (tmp_path / name).write_bytes(data)
        parts = [bytearray(n) for n in sizes]
        return (str(tmp_path / name), parts), payload

    def flip(at: int) -> Callable[[bytearray], None]:
        def f(b: bytearray) -> None:
            b[at] ^= 1

        return f

    good = [
        page(f"g{i}", sizes) for i, sizes in enumerate([[1], [4096], [300, 5000], [1, 2, 3, 70000], [0, 17]])
    ]
    assert fastio.read_verify_pages([item for item, _ in good]) == [0] * len(good)
    for (_, parts), payload in good:
        assert b"".join(parts) == payload
    hsize = fmt.header_size(2)
    bad = [
        page("b0", [64], flip(-1)),  # payload
        page("b1", [64], flip(16)),  # stored checksum
        page("b2", [64], flip(0)),  # magic
        page("b3", [64], flip(24)),  # key
        page("b4", [64], flip(hsize - 1)),  # padding
        page("b5", [64], lambda b: b.append(0)),  # trailing data
        page("b6", [64], lambda b: b.pop()),  # truncated
        page("b7", [64], flip(8)),  # payload length field
        page("b8", [64], flip(6)),  # key length field
    ]
    other = bytes(range(64))  # a valid page of key "zz", stored under the name "b9"
    (tmp_path / "b9").write_bytes(fmt.encode_header(b"zz", 64, fmt.checksum([other])) + other)
    bad.append(((str(tmp_path / "b9"), [bytearray(64)]), b""))
    missing = (str(tmp_path / "nope"), [bytearray(8)])
    assert fastio.read_verify_pages([item for item, _ in bad] + [missing]) == [1] * len(bad) + [-2]
    assert fastio.read_verify_pages([]) == []
    with pytest.raises(ValueError):  # the path must end with "/<key>"
        fastio.read_verify_pages([("no-slash", [bytearray(1)])])
    with pytest.raises(ValueError):
        fastio.read_verify_pages([(str(tmp_path) + "/", [bytearray(1)])])
    with pytest.raises(TypeError):
        fastio.read_verify_pages([(b"/bytes/path", [bytearray(1)])])
    with pytest.raises(BufferError):  # the payload buffers are written into
        fastio.read_verify_pages([(str(tmp_path / "g0"), [b"x"])])


@needs_native
def test_c_write_checksums_equal_the_python_ones(tmp_path: Path) -> None:
    """``publish_pages_xxh3`` writes ``_format``'s header (key from the path, payload length,
    ``_format.checksum`` of the payload), then the payload, into the path's directory."""
    from hicache_file import _format as fmt

    fastio = _native_io._fastio
    assert fastio is not None
    if not fastio.HAVE_XXH3:
        pytest.skip("_fastio found no XXH3 in python-xxhash: writes checksum in Python")
    gen = torch.Generator().manual_seed(11)
    items, parts_of = [], []
    for i, sizes in enumerate([[1], [4096], [300, 5000], [1, 2, 3, 70000], [0, 17], [0]]):
        parts = [
            torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes() for n in sizes
        ]
        parts_of.append(parts)
        items.append((str(tmp_path / "sub" / f"ns.k{i}-{'x' * (i * 17)}"), parts, True))
    (tmp_path / "sub").mkdir()
    assert fastio.publish_pages_xxh3(items) == [0] * len(items)
    for (path, _, _), parts in zip(items, parts_of):
        digest = fmt.checksum(parts)
        assert Path(path).read_bytes() == fmt.encode_header(
            Path(path).name.encode(), sum(map(len, parts)), digest
        ) + b"".join(parts)
    # a present page is skipped (not rewritten), and reads back as before
    first = Path(items[0][0]).read_bytes()
    assert fastio.publish_pages_xxh3([(items[0][0], [b"other"], True)]) == [1]
    assert Path(items[0][0]).read_bytes() == first
    with pytest.raises(ValueError):  # no payload buffer
        fastio.publish_pages_xxh3([(str(tmp_path / "t"), [], True)])
    with pytest.raises(ValueError):  # the path must end with "/<key>"
        fastio.publish_pages_xxh3([("no-slash", [b"x"], True)])
    with pytest.raises(ValueError):
        fastio.publish_pages_xxh3([(str(tmp_path) + "/", [b"x"], True)])
    with pytest.raises(ValueError):  # a key longer than the header's 16-bit length field
        fastio.publish_pages_xxh3([(str(tmp_path / ("k" * 65536)), [b"x"], True)])
    assert not (tmp_path / "t").exists()


@needs_native
def test_c_page_headers_are_the_format_s() -> None:
    """The headers C builds for ``*_pages`` are byte for byte ``_format.encode_header``'s."""
    from hicache_file import _format as fmt

    fastio = _native_io._fastio
    assert fastio is not None
    for klen in (1, 2, 39, 40, 41, 103, 104, 255, 1000, 65535):
        key = bytes((ord("a") + i % 26) for i in range(klen))
        for n in (0, 1, 16384, 2**32 + 5, 2**64 - 1):
            assert fastio.page_header(key, n) == fmt.encode_header(key, n, 0)
    for bad in (b"", b"k" * 65536):
        with pytest.raises(ValueError):
            fastio.page_header(bad, 1)


@needs_native
def test_publish_creates_a_missing_namespace_and_shard(tmp_path: Path) -> None:
    """The first page of a namespace needs no Python retry: C creates both directory levels."""
    fastio = _native_io._fastio
    assert fastio is not None
    shard = tmp_path / "ns" / "abc"
    assert fastio.publish_batch([(f"{shard}/", f"{shard}/k-abc", [b"payload"], True)]) == [0]
    assert (shard / "k-abc").read_bytes() == b"payload"
    deeper = tmp_path / "a" / "b" / "c"  # two missing parents: Python's job (-ENOENT)
    assert fastio.publish_batch([(f"{deeper}/", f"{deeper}/k", [b"x"], True)]) == [-2]
    assert not (tmp_path / "a" / "b").exists()


@needs_native
def test_threads_give_the_same_results_as_one(tmp_path: Path) -> None:
    """Every ``_fastio`` call shares its items out among ``threads`` threads: per-item results
    (published, skipped, failed; valid, damaged, missing; present or not) stay in item order
    and equal a single thread's, whatever the thread count (capped at the item count)."""
    from hicache_file import _format as fmt

    fastio = _native_io._fastio
    assert fastio is not None
    gen = torch.Generator().manual_seed(5)
    n = 97
    payloads = [torch.randint(0, 256, (100 + 37 * i,), dtype=torch.uint8, generator=gen) for i in range(n)]

    sums = _native_io.checksums_in_c()

    def items(root: Path) -> list[tuple[object, ...]]:
        out: list[tuple[object, ...]] = []
        for i, p in enumerate(payloads):
            key, data = f"k{i:03d}", p.numpy().tobytes()
            shard = root / ("s" if i % 3 else "missing-shard")  # created by C on first use
            if sums:  # C builds the header
                out.append((f"{shard}/{key}", [data], True))
            else:
                head = fmt.encode_header(key.encode(), len(data), fmt.xxh3_64(data))
                out.append((f"{shard}/", f"{shard}/{key}", [head, data], True))
        deep = f"{root}/a/b/c"  # two missing parents: -ENOENT
        out[7] = (
            (f"{deep}/k", [b"x"], True) if sums else (f"{deep}/", f"{deep}/k", [bytearray(64), b"x"], True)
        )
        return out

    results = {}
    for threads in (1, 2, 5, 500):
        root = tmp_path / f"t{threads}"
        root.mkdir()
        publish = fastio.publish_pages_xxh3 if sums else fastio.publish_batch
        first = publish(items(root), threads)
        again = publish(items(root), threads)  # all present now
        (root / "s" / "k001").write_bytes(b"damaged")
        paths = [str(it[0 if sums else 1]) for it in items(root)]
        exists = fastio.exists_batch(paths, threads)
        reads = [(p, bytearray(fmt.header_size(4)), [bytearray(len(d))]) for p, d in zip(paths, payloads)]
        got = fastio.read_batch([(p, [h, *b, bytearray(1)]) for p, h, b in reads], threads)
        verify = None
        if sums:
            outs = [[bytearray(len(d))] for d in payloads]
            verify = fastio.read_verify_pages(list(zip(paths, outs)), threads)
            assert all(
                bytes(o[0]) == d.numpy().tobytes() for o, d, v in zip(outs, payloads, verify) if v == 0
            )
        results[threads] = (first, again, exists, got, verify)
    first, again, exists, got, verify = results[1]
    assert first.count(0) == n - 1 and first[7] == -2
    assert again.count(1) == n - 1 and again[7] == -2
    assert exists.count(True) == n - 1 and exists[7] is False
    assert got[7] == -2 and got[1] == len(b"damaged")
    if verify is not None:
        assert verify.count(0) == n - 2 and verify[1] == 1 and verify[7] == -2
    assert all(results[t] == results[1] for t in results)
    with pytest.raises(ValueError, match="threads"):
        fastio.exists_batch(paths, 0)
