"""Reference worker: the disk's raw limit on the same bytes (not a peer; never in the ratios).

Standard library only, run with the repository's venv. One file, preallocated (untimed), all the
pages back to back. Durable: ``O_DIRECT`` sequential ``pwrite`` of every page then
``fdatasync``. Cold: ``O_DIRECT`` ``preadv`` of every page at queue depth 4 (four threads, each
its own quarter; the faster depth on this disk, see the README). Warm: buffered ``preadv``
from the page cache (filled by an untimed buffered read first). Setting: ``default``.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

DEPTH = 4


class RawFile:
    def __init__(self, root: str, page_bytes: int, n: int, setting: str) -> None:
        self.path = os.path.join(root, "raw.bin")
        self.page_bytes, self.n = page_bytes, n
        self.src = mmap.mmap(-1, page_bytes * n)  # page-aligned, as O_DIRECT needs
        self.dst = mmap.mmap(-1, page_bytes * n)
        self.phase = "cold"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, page_bytes * n)
            os.fsync(fd)
        finally:
            os.close(fd)

    def fill(self, i: int, data: memoryview) -> None:
        self.src[i * self.page_bytes : (i + 1) * self.page_bytes] = data

    def write(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
        try:
            view = memoryview(self.src)
            for i in range(self.n):
                off = i * self.page_bytes
                os.pwrite(fd, view[off : off + self.page_bytes], off)
        finally:
            os.close(fd)

    def _read(self, flags: int, depth: int) -> None:
        fd = os.open(self.path, os.O_RDONLY | flags)
        view = memoryview(self.dst)
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
        if self.phase == "cold":
            self._read(os.O_DIRECT, DEPTH)
        else:
            self._read(0, 1)
        return self.n

    def page(self, i: int) -> bytes:
        return self.dst[i * self.page_bytes : (i + 1) * self.page_bytes]

    def close(self) -> None:
        pass


def _load() -> tuple[_common.Factory, dict[str, str]]:
    return RawFile, {"python": sys.version.split()[0]}


if __name__ == "__main__":
    sys.exit(_common.serve(_load))
