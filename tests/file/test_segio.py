"""One run of the segment layout's O_DIRECT I/O (``hicache_file._segio``): components whose
buffers are 4096-aligned move straight from / into them, any other goes through the staging
buffer; both kinds in one run, and a damaged or missing component of either kind is a miss.
With ``direct_io="auto"`` a run wholly in the page cache is read through a buffered fd, with the
same checks, and writes stay ``O_DIRECT`` only with ``fsync``."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from file_helpers import config, fill, pages, zero
from hicache_file import _segio
from hicache_file._segio import CORRUPT, OK, SHORT, _aligned, _all_cached, probe_direct, read_run, write_run

from hicache_core import CacheController, MHAKVPool, page_hashes
from hicache_core.pools import torch_allocator

ALIGN = 4096


def _region(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n))  # page aligned


def _items(base: memoryview) -> list[tuple[list[memoryview], int]]:
    """Four components over ``base``: aligned (one buffer), 64 bytes off, aligned in two
    per-layer buffers, and aligned but of an odd length (padded in the segment)."""
    return [
        ([base[0:8192]], 8192),
        ([base[8192 + 64 : 8192 + 64 + 4096]], 4096),
        ([base[16384:20480], base[24576:28672]], 8192),
        ([base[32768 : 32768 + 1000]], 1000),
    ]


@pytest.fixture
def direct_fd(tmp_path: Path) -> Iterator[int]:
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        why = probe_direct(dfd)
    finally:
        os.close(dfd)
    if why is not None:
        pytest.skip(f"no O_DIRECT under {tmp_path}: {why}")
    fd = os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    yield fd
    os.close(fd)


def test_aligned_and_staged_components_in_one_run(direct_fd: int) -> None:
    src = _region(40960)
    src[:] = os.urandom(len(src))
    items = _items(src)
    assert [_aligned(p) for p, _ in items] == [True, False, True, False]
    digests = write_run(direct_fd, True, ALIGN, items)  # offset: not the file's start
    dst = _region(40960)
    got = _items(dst)
    assert read_run(direct_fd, True, ALIGN, got, digests) == [OK] * 4
    for (a, _), (b, _) in zip(items, got):
        assert b"".join(bytes(p) for p in a) == b"".join(bytes(p) for p in b)

    on_disk = 8192 + 4096 + 8192 + 4096
    with open(f"/proc/self/fd/{direct_fd}", "rb") as f:  # a buffered reader sees the direct writes
        raw = os.pread(f.fileno(), on_disk, ALIGN)
    assert raw[8192 : 8192 + 4096] == src[8192 + 64 : 8192 + 64 + 4096]  # laid out back to back
    assert raw[-4096 + 1000 :] == bytes(3096)  # zero padding after the odd-sized component


def test_a_flipped_byte_is_corrupt_in_either_kind_and_a_short_segment_is_short(direct_fd: int) -> None:
    src = _region(40960)
    src[:] = os.urandom(len(src))
    items = _items(src)
    digests = write_run(direct_fd, True, 0, items)
    buf = _region(ALIGN)
    for off in (100, 8192 + 100):  # inside component 0 (aligned) and 1 (staged)
        os.preadv(direct_fd, [buf], off & -ALIGN)
        buf[off % ALIGN] ^= 0x01
        os.pwritev(direct_fd, [buf], off & -ALIGN)
    dst = _region(40960)
    dst[:] = b"\xaa" * len(dst)
    status = read_run(direct_fd, True, 0, _items(dst), digests)
    assert status == [CORRUPT, CORRUPT, OK, OK]
    assert bytes(dst[8192 + 64 : 8192 + 64 + 4096]) == b"\xaa" * 4096  # a staged miss leaves the pool alone
    os.ftruncate(direct_fd, 8192 + 4096 + 8192)  # the last component is gone
    assert read_run(direct_fd, True, 0, _items(dst), digests)[3] == SHORT


def test_default_pool_pages_are_aligned_for_zero_copy() -> None:
    """The default allocator's regions start on 4096 bytes (2 MiB from 2 MiB up, where they are
    advised huge pages) and are zeroed, so a ``page_first`` page of 4 KiB multiples needs no
    staging."""
    for n, align in ((1, ALIGN), (5000, ALIGN), (2 << 20, 2 << 20), ((3 << 20) + 1, 2 << 20)):
        t = torch_allocator(n)
        assert (t.numel(), t.dtype, t.data_ptr() % align) == (n, torch.uint8, 0)
        assert not t.any()
    pool = MHAKVPool(4, 16, 2, 2, 64, torch.bfloat16)  # 4 KiB per layer and component
    views = [memoryview(b[1].numpy()).cast("B") for b in pool.buffers()]
    assert all(_aligned([v]) for v in views)


@pytest.fixture
def spied_fds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fds ``read_run`` reads from, in order."""
    used: list[int] = []
    real = os.preadv

    def preadv(fd: int, *args: object) -> int:
        used.append(fd)
        return real(fd, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_segio.os, "preadv", preadv)
    return used


def test_a_cached_run_is_read_from_the_page_cache_checked_and_a_cold_one_direct(
    direct_fd: int, tmp_path: Path, spied_fds: list[int]
) -> None:
    if not _segio.has_cachestat():
        pytest.skip("no cachestat(2) (Linux 6.5)")
    bfd = os.open(tmp_path / "seg", os.O_RDWR)
    try:
        src = _region(40960)
        src[:] = os.urandom(len(src))
        items = _items(src)
        digests = write_run(bfd, False, 0, items)  # buffered: the pages stay cached
        assert _all_cached(bfd, 0, 24576)
        dst = _region(40960)
        assert read_run(direct_fd, True, 0, _items(dst), digests, bfd) == [OK] * 4
        assert set(spied_fds) == {bfd}
        for (a, _), (b, _) in zip(items, _items(dst)):
            assert b"".join(bytes(p) for p in a) == b"".join(bytes(p) for p in b)

        os.pwrite(bfd, bytes([src[100] ^ 1]), 100)  # a damaged cached (dirty) page: still a miss
        os.pwrite(bfd, bytes([src[8192 + 64 + 5] ^ 1]), 8192 + 5)  # and in a staged component
        spied_fds.clear()
        assert read_run(direct_fd, True, 0, _items(dst), digests, bfd) == [CORRUPT, CORRUPT, OK, OK]
        assert set(spied_fds) == {bfd}

        os.pwrite(bfd, bytes([src[100]]), 100)
        os.pwrite(bfd, bytes([src[8192 + 64 + 5]]), 8192 + 5)
        os.fdatasync(bfd)
        os.posix_fadvise(bfd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert not _all_cached(bfd, 0, 24576)
        spied_fds.clear()
        dst[:] = bytes(len(dst))
        assert read_run(direct_fd, True, 0, _items(dst), digests, bfd) == [OK] * 4  # cold: O_DIRECT
        assert set(spied_fds) == {direct_fd}
        assert bytes(dst[8192 + 64 : 8192 + 64 + 4096]) == bytes(src[8192 + 64 : 8192 + 64 + 4096])
        assert not _all_cached(bfd, 0, 24576)  # and it left nothing in the page cache
    finally:
        os.close(bfd)


@pytest.mark.parametrize("fsync", [True, False])
def test_auto_writes_direct_only_with_fsync(tmp_path: Path, fsync: bool) -> None:
    pool = MHAKVPool(4, 16, 2, 2, 64, torch.bfloat16)
    fill(pool, 3)
    want = pages(pool, range(4))
    hashes = page_hashes(list(range(16)), 4)
    cfg = config(tmp_path / "r", options={"layout": "segments", "fsync": fsync}, model_name="seg")
    with CacheController(cfg, pool) as ctl:
        seg = ctl.store.backend.segments
        if not seg.direct:
            pytest.skip(f"no O_DIRECT under {tmp_path}")
        assert ctl.backup(hashes, range(4)).pages == 4
        assert bool(fcntl.fcntl(seg._cur.fd, fcntl.F_GETFL) & os.O_DIRECT) == fsync
        zero(pool)
        assert ctl.prefetch(hashes, range(4)).pages == 4
        assert pages(pool, range(4)) == want
