"""One run of the segment layout's O_DIRECT I/O (``hicache_file._segio``): components whose
buffers are 4096-aligned move straight from / into them, any other goes through the staging
buffer; both kinds in one run, and a damaged or missing component of either kind is a miss."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hicache_file._segio import CORRUPT, OK, SHORT, _aligned, probe_direct, read_run, write_run

from hicache_core import MHAKVPool
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
