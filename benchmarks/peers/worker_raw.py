"""Reference worker: the disk's raw limit on the same bytes (not a peer; never in the ratios).

Standard library only, run with the repository's venv. One file, created and preallocated
(``posix_fallocate`` + ``fsync``, untimed), all the pages back to back. Setting: the queue
depth, ``"1"`` or ``"4"`` (``bench_peers`` runs both and reports the faster per round as the raw
limit). Durable: ``O_DIRECT`` ``pwrite`` of every page, ``depth`` in flight (threads taking the
next page in file order), then the ``fdatasync`` every contender pays
(``_common.make_durable``). Cold: ``O_DIRECT`` ``preadv`` of every page,
``depth`` threads each reading its own share. Warm: the same buffered, from the page cache
(filled by an untimed buffered read first). Source and destination are 2 MiB-aligned private
anonymous memory advised ``MADV_HUGEPAGE``: the kind hicache's host pools get (``O_DIRECT`` from
4 KiB-page memory pins every page per I/O: it wrote 1.3-1.4 GB/s here against 2.0 from huge
pages, ``benchmarks/README.md``, "Twelfth session: durable").
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

HUGE = 2 << 20


def huge_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """``nbytes`` of anonymous memory starting on a 2 MiB boundary, advised ``MADV_HUGEPAGE``
    (before the first touch; where refused, ordinary pages)."""
    # private: shared anonymous memory (mmap's default) is shmem, which madvise does not make huge
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % HUGE
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None:
        try:
            m.madvise(advise, start, nbytes)
        except OSError:
            pass
    return m, memoryview(m)[start : start + nbytes]


class RawFile:
    def __init__(self, root: str, page_bytes: int, n: int, setting: str) -> None:
        self.path = os.path.join(root, "raw.bin")
        self.page_bytes, self.n = page_bytes, n
        self.depth = int(setting) if setting.isdigit() else 1
        self._maps: list[mmap.mmap] = []
        self.src = self._buffer(page_bytes * n)
        self.dst = self._buffer(page_bytes * n)
        self.phase = "cold"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, page_bytes * n)
            os.fsync(fd)
        finally:
            os.close(fd)

    def fill(self, i: int, data: memoryview) -> None:
        self.src[i * self.page_bytes : (i + 1) * self.page_bytes] = data

    def _buffer(self, nbytes: int) -> memoryview:
        m, view = huge_buffer(nbytes)
        self._maps.append(m)
        return view

    def write(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
        pages = iter(range(self.n))  # next() is atomic under the GIL: each page written once
        errors: list[BaseException] = []

        def part() -> None:
            try:
                for i in pages:
                    off = i * self.page_bytes
                    if os.pwrite(fd, self.src[off : off + self.page_bytes], off) != self.page_bytes:
                        raise OSError(f"short write of page {i}")
            except BaseException as err:
                errors.append(err)

        try:
            threads = [threading.Thread(target=part) for _ in range(self.depth - 1)]
            for t in threads:
                t.start()
            part()
            for t in threads:
                t.join()
        finally:
            os.close(fd)
        if errors:
            raise errors[0]

    def _read(self, flags: int, depth: int) -> None:
        fd = os.open(self.path, os.O_RDONLY | flags)
        view = self.dst
        errors: list[BaseException] = []

        def part(lo: int, hi: int) -> None:
            try:
                for i in range(lo, hi):
                    off = i * self.page_bytes
                    if os.preadv(fd, [view[off : off + self.page_bytes]], off) != self.page_bytes:
                        raise OSError(f"short read of page {i}")
            except BaseException as err:
                errors.append(err)

        try:
            bounds = [self.n * k // depth for k in range(depth + 1)]
            threads = [threading.Thread(target=part, args=(bounds[k], bounds[k + 1])) for k in range(depth)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            os.close(fd)
        if errors:
            raise errors[0]

    def prepare_warm(self) -> None:
        self._read(0, 1)

    def clear(self) -> None:
        self.dst[:] = bytes(len(self.dst))

    def read(self) -> int:
        self._read(os.O_DIRECT if self.phase == "cold" else 0, self.depth)
        return self.n

    def page(self, i: int) -> bytes:
        return bytes(self.dst[i * self.page_bytes : (i + 1) * self.page_bytes])

    def close(self) -> None:
        pass


def _load() -> tuple[_common.Factory, dict[str, str]]:
    return RawFile, {"python": sys.version.split()[0]}


if __name__ == "__main__":
    sys.exit(_common.serve(_load))
