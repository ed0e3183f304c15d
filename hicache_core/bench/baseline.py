"""Raw baselines measured side by side with the hicache phases, on the same bytes.

* :class:`RawFiles`: one file per page component (the objects a backend stores), written with
  ``os.write`` into new files and read back with ``os.readv`` (``readinto`` semantics), straight
  from/into the same host-pool views, with as many threads as the controller has I/O threads, in
  a directory on the backend's filesystem. The writer process writes; the fresh verifier process
  reads, interleaved with its prefetches.
* :class:`Memcpy`: for backends without a filesystem root, one ``copy_`` per page component into
  a preallocated, pre-faulted region and back.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ..pools import HostPoolGroup
from ..types import PoolName

__all__ = ["Memcpy", "RawFiles", "byte_view", "component_views"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor (no numpy, no copy).

    The caller keeps ``t`` alive while the view is used.
    """
    if t.dtype != torch.uint8 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous torch.uint8 CPU tensor")
    n = t.numel()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def component_views(group: HostPoolGroup, pools: Sequence[PoolName]) -> list[torch.Tensor]:
    """Every page (slot) component view of ``pools``, in a fixed order: the objects stored."""
    views: list[torch.Tensor] = []
    for name in pools:
        pool = group[name]
        for page in pool.page_views(range(pool.num_pages)):
            views.extend(page)
    return views


class RawFiles:
    """Raw file I/O of ``views`` (object ``i`` <-> file ``obj{i}`` in ``directory``)."""

    def __init__(self, directory: str, views: Sequence[torch.Tensor], threads: int, fsync: bool) -> None:
        self.directory = directory
        self.threads = max(1, threads)
        self.fsync = fsync
        self._views = list(views)  # keeps the memory of the byte views alive
        self._mvs = [byte_view(v) for v in self._views]
        self._paths = [os.path.join(directory, f"obj{i:07d}") for i in range(len(views))]
        step = -(-len(self._paths) // self.threads) if self._paths else 1
        self._parts = [range(s, min(s + step, len(self._paths))) for s in range(0, len(self._paths), step)]

    @property
    def name(self) -> str:
        return (
            f"raw os.write + os.readv (readinto), one file per page component, {self.threads} thread(s)"
            + (", fsync" if self.fsync else "")
        )

    @property
    def nbytes(self) -> int:
        return sum(len(m) for m in self._mvs)

    def _timed(self, fn: Callable[[range], None]) -> float:
        with ThreadPoolExecutor(self.threads, thread_name_prefix="hicache-raw") as pool:
            t0 = time.perf_counter()
            list(pool.map(fn, self._parts))
            return time.perf_counter() - t0

    def write(self) -> float:
        """Write every object into a new file; return the wall seconds."""
        self.remove()
        return self._timed(self._write_part)

    def read(self) -> float:
        """Read every file back into its view; return the wall seconds."""
        return self._timed(self._read_part)

    def remove(self) -> None:
        for p in self._paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def _write_part(self, idx: range) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC
        for i in idx:
            fd = os.open(self._paths[i], flags, 0o644)
            try:
                mv, done = self._mvs[i], 0
                while done < len(mv):
                    done += os.write(fd, mv[done:])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def _read_part(self, idx: range) -> None:
        for i in idx:
            fd = os.open(self._paths[i], os.O_RDONLY | _O_CLOEXEC)
            try:
                mv, done = self._mvs[i], 0
                while done < len(mv):
                    n = os.readv(fd, [mv[done:]])
                    if n == 0:
                        raise OSError(f"raw baseline: short read of {self._paths[i]}")
                    done += n
            finally:
                os.close(fd)


class Memcpy:
    """One ``copy_`` per page component into a preallocated, pre-faulted region and back."""

    name = "memcpy (torch copy_ per page component, in process)"

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        self._views = list(views)
        self.nbytes = sum(v.numel() for v in self._views)
        region = torch.zeros(self.nbytes, dtype=torch.uint8)
        self._slots, off = [], 0
        for v in self._views:
            self._slots.append(region[off : off + v.numel()].view(v.shape))
            off += v.numel()

    def write(self) -> float:
        t0 = time.perf_counter()
        for dst, src in zip(self._slots, self._views):
            dst.copy_(src)
        return time.perf_counter() - t0

    def read(self) -> float:
        t0 = time.perf_counter()
        for src, dst in zip(self._slots, self._views):
            dst.copy_(src)
        return time.perf_counter() - t0
