"""Corrupt, truncated, misplaced or foreign files read as misses, are counted, logged and removed."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from file_helpers import config, fill, pages, zero
from hicache_file._format import header_size
from hicache_file._page_io import PIECE, SPLIT

from hicache_core import CacheController, IoOp, MHAKVPool, open_store, page_hashes

KEY = "ns-x.kv.k.tp0of1.00aa11bb22cc"
OTHER = "ns-x.kv.k.tp0of1.99ff88ee77dd"
N = 4096
assert header_size(len(KEY)) > 24 + len(KEY), "KEY must leave padding before the payload"


def _flip(offset: int) -> Callable[[str], None]:
    def damage(path: str) -> None:
        pos = offset if offset >= 0 else os.path.getsize(path) + offset
        with open(path, "r+b") as f:
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x10]))

    return damage


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 1)


def _truncate_header(path: str) -> None:
    os.truncate(path, 10)


def _append(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"x")


def _empty(path: str) -> None:
    os.truncate(path, 0)


DAMAGE = {
    "payload bit flip": _flip(-100),
    "checksum bit flip": _flip(17),
    "magic": _flip(0),
    "version": _flip(4),
    "key bit flip": _flip(30),
    "padding byte": _flip(header_size(len(KEY)) - 1),  # the zeros between key and payload
    "truncated payload": _truncate,
    "truncated header": _truncate_header,
    "empty file": _empty,
    "trailing data": _append,
}


# a payload read header first, then in pieces (_page_io.PIECE each, checksummed one by one): the
# last piece short; and one of SPLIT bytes, header first then one piece
BIG = 3 * PIECE + 4160
assert N < SPLIT <= PIECE < BIG
DAMAGE_BIG = {
    **DAMAGE,
    "bit flip in the first piece": _flip(header_size(len(KEY)) + 5),
    "bit flip in a middle piece": _flip(header_size(len(KEY)) + PIECE + 7),
    "bit flip in the last piece": _flip(-1),
    "truncated to whole pieces": lambda p: os.truncate(p, header_size(len(KEY)) + 2 * PIECE),
}


@pytest.mark.parametrize(
    ("n", "kind"), [(n, k) for n in (N, SPLIT) for k in DAMAGE] + [(BIG, k) for k in DAMAGE_BIG]
)
def test_damaged_page_is_a_counted_miss_and_removed(
    tmp_path: Path, n: int, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    with open_store(config(tmp_path)) as store:
        backend = store.backend
        assert store.batch_io_v1(IoOp.SET, [KEY], [data]) == [True]
        path = backend.path_of(KEY)
        DAMAGE_BIG[kind](path)
        out = torch.zeros(n, dtype=torch.uint8)
        with caplog.at_level(logging.WARNING, logger="hicache.file"):
            assert store.batch_io_v1(IoOp.GET, [KEY], [out]) == [False]
        assert backend.stats.integrity_errors == 1
        assert backend.integrity_errors == 1
        assert "corrupt page" in caplog.text and path in caplog.text
        assert not os.path.exists(path), "a corrupt page must be removed so it can be rewritten"
        assert store.batch_io_v1(IoOp.EXISTS, [KEY]) == [False]
        assert store.batch_io_v1(IoOp.SET, [KEY], [data]) == [True]
        assert store.batch_io_v1(IoOp.GET, [KEY], [out]) == [True]
        assert torch.equal(out, data)


def test_wrong_key_in_header_is_detected(tmp_path: Path) -> None:
    a = torch.randint(0, 256, (N,), dtype=torch.uint8)
    b = torch.randint(0, 256, (N,), dtype=torch.uint8)
    with open_store(config(tmp_path)) as store:
        backend = store.backend
        assert store.batch_io_v1(IoOp.SET, [KEY, OTHER], [a, b]) == [True, True]
        # a misplaced/colliding file: KEY's bytes (valid checksum) under OTHER's name
        shutil.copyfile(backend.path_of(KEY), backend.path_of(OTHER))
        out = torch.zeros(N, dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.GET, [OTHER], [out]) == [False]
        assert backend.stats.integrity_errors == 1
        assert not os.path.exists(backend.path_of(OTHER))
        assert store.batch_io_v1(IoOp.GET, [KEY], [out]) == [True] and torch.equal(out, a)


def test_size_mismatch_is_a_plain_miss(tmp_path: Path) -> None:
    data = torch.randint(0, 256, (N,), dtype=torch.uint8)
    with open_store(config(tmp_path)) as store:
        backend = store.backend
        assert store.batch_io_v1(IoOp.SET, [KEY], [data]) == [True]
        for size in (N // 2, N * 2):
            assert store.batch_io_v1(IoOp.GET, [KEY], [torch.zeros(size, dtype=torch.uint8)]) == [False]
        assert backend.stats.size_mismatches == 2
        assert backend.stats.integrity_errors == 0
        assert os.path.exists(backend.path_of(KEY)), "a valid page of another size is kept"
        out = torch.zeros(N, dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.GET, [KEY], [out]) == [True] and torch.equal(out, data)


def test_corrupt_page_cuts_the_prefetched_prefix(tmp_path: Path) -> None:
    kv = MHAKVPool(8, 4, 2, 2, 8)
    fill(kv, 3)
    want = pages(kv, range(3))
    hashes = page_hashes(list(range(32)), 4)
    with CacheController(config(tmp_path), kv) as ctl:
        assert ctl.backup(hashes, range(8)).ok
        key_v3 = ctl.store.page_keys("kv", [hashes[3]])[0][1]
        path = ctl.store.backend.path_of(key_v3)
        _flip(-1)(path)
        zero(kv)
        res = ctl.prefetch(hashes, range(8))
        assert res.pages == 3
        assert pages(kv, range(3)) == want
        assert ctl.store.backend.stats.integrity_errors == 1
        # the next backup rewrites the removed page; then everything restores again
        fill(kv, 3)
        before = ctl.store.backend.stats  # a snapshot
        assert ctl.backup(hashes, range(8)).ok  # only the removed V file is written again
        after = ctl.store.backend.stats
        assert (after.writes - before.writes, after.skipped_writes - before.skipped_writes) == (1, 15)
        assert ctl.prefetch(hashes, range(8)).pages == 8


@pytest.mark.parametrize(
    "n", [SPLIT - 1, SPLIT, SPLIT + 1, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE, 15 * PIECE + 3]
)
def test_piecewise_read_gives_the_stored_bytes_and_checksum(
    tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Payloads around the split and piece sizes: read header first then piece by piece (their
    streamed xxh3_64 checked against the one-shot digest stored at write time), header first then
    in one piece, and in one ``readv`` with the header, they give the same bytes; so every read
    shape verifies exactly what the format stores, and pages written before it still read."""
    import hicache_file._page_io as page_io

    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    with open_store(config(tmp_path)) as store:
        assert store.batch_io_v1(IoOp.SET, [KEY], [data]) == [True]
        for split, piece in ((SPLIT, PIECE), (SPLIT, 1 << 62), (1 << 62, PIECE)):
            monkeypatch.setattr(page_io, "SPLIT", split)
            monkeypatch.setattr(page_io, "PIECE", piece)
            out = torch.zeros(n, dtype=torch.uint8)
            assert store.batch_io_v1(IoOp.GET, [KEY], [out]) == [True]
            assert torch.equal(out, data)
        assert store.backend.stats.integrity_errors == 0


@pytest.mark.parametrize("n", [SPLIT - 1, SPLIT, 3 * PIECE + 5])
def test_a_large_payload_is_read_header_first(
    tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From SPLIT bytes up, the first read of a page file asks for its header alone: what the first
    read of an uncached file asks for shapes the kernel's readahead (large folios, asynchronous;
    see ``hicache_file._page_io``), worth 20-50 % on the next read of the page. Then the payload
    in pieces of at most PIECE bytes and one spare byte; below SPLIT, one ``readv`` of it all."""
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    hsize = header_size(len(KEY))
    calls: list[list[int]] = []
    real = os.readv

    def readv(fd: int, bufs: list[memoryview | bytearray]) -> int:
        calls.append([len(memoryview(b).cast("B")) for b in bufs])
        return real(fd, bufs)

    with open_store(config(tmp_path)) as store:
        assert store.batch_io_v1(IoOp.SET, [KEY], [data]) == [True]
        out = torch.zeros(n, dtype=torch.uint8)
        monkeypatch.setattr(os, "readv", readv)
        assert store.batch_io_v1(IoOp.GET, [KEY], [out]) == [True]
        monkeypatch.undo()
        assert torch.equal(out, data)
    if n < SPLIT:
        assert calls == [[hsize, n, 1]]
    else:
        assert calls[0] == [hsize]
        assert sum(map(sum, calls[1:])) == n + 1 and calls[-1][-1] == 1
        assert all(c[0] <= PIECE for c in calls[1:])
