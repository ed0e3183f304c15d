"""Moving runs of page components to and from one segment file (the segment layout's I/O).

A *run* is a list of page components that lie back to back in a segment, each starting on a
multiple of :data:`~hicache_file._seglog.ALIGN`. One run is one ``pwrite`` / ``pread``:

* ``O_DIRECT`` (when the filesystem takes it, probed at open by :func:`probe_direct`): one
  ``pwritev`` / ``preadv`` per run, every buffer block-aligned in address and length as
  ``O_DIRECT`` requires. A component whose buffers are all :data:`ALIGN`-aligned (the default
  pool allocator starts pools on a 4096-byte boundary, so a ``page_first`` page of a multiple of
  4 KiB is) moves straight from / into the pool views and is checksummed there; any other
  component goes through a page-aligned staging buffer of the calling thread: copied in with
  zero padding for a write, read there, checked, and copied out only when verified for a read.
  Bypassing the page cache is what makes durable writes and cold reads run near the disk's own
  speed; skipping the copy (into pools the allocator backs with huge pages) halves the CPU per
  GB moved and is 15-39 % faster than staging (``benchmarks/README.md``).
* buffered (no ``O_DIRECT``): ``pwritev`` / ``preadv`` straight from / into the pool views
  (zero padding from a shared zero buffer, read padding into a scratch sink), checksummed over
  the views.
* page cache first (``direct_io="auto"``, given a second, buffered fd of the segment): when
  ``cachestat(2)`` (Linux 6.5) says every page of the run is in the page cache, the run is read
  through the buffered fd into the same buffers (memory speed), else with ``O_DIRECT`` as above
  (disk speed, no second copy in the page cache). Not ``preadv(..., RWF_NOWAIT)``: on a page
  that is not cached it starts readahead before returning ``EAGAIN``, so a cold run is read
  twice (measured 0.34-0.74x cold, ``benchmarks/README.md``). Both fds see the same bytes: the
  kernel writes back dirty cached pages of a range before an ``O_DIRECT`` read of it, and an
  ``O_DIRECT`` write drops the cached pages it overwrites; a page evicted between the check and
  the read is read from the disk. Every item is checksummed after the read, as on every path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from . import _format as fmt
from ._dirs import O_CLOEXEC, O_NOFOLLOW, describe, open_dir
from ._errors import FileRootError
from ._pool_io import MAX_IOV
from ._publish import sweep_dir, temp_name
from ._seglog import ALIGN

__all__ = [
    "CHUNK",
    "DIRECT_DEPTH",
    "DIRECT_RUN",
    "O_DIRECT",
    "PROBE_PREFIX",
    "Item",
    "Seg",
    "close_seg",
    "has_cachestat",
    "open_subdir",
    "probe_direct",
    "read_run",
    "run_parallel",
    "split_runs",
    "sweep_probes",
    "sync_parallel",
    "write_run",
]

O_DIRECT = getattr(os, "O_DIRECT", 0)
CHUNK = 4 << 20
"""Target bytes of one buffered run (one syscall through the page cache)."""
DIRECT_RUN = 1 << 20
DIRECT_DEPTH = 8
"""``O_DIRECT`` runs of about ``DIRECT_RUN`` bytes (whole components; a page may span runs), up to
``DIRECT_DEPTH`` in flight (threads that mostly wait for the disk): on this project's VM disk,
against 2 x 4 MiB runs of whole pages, cold reads 1.21x / 1.07x and durable writes 1.22x / 1.05x
faster at 2 MiB / 256 KiB pages (paired medians, ``benchmarks/README.md``, "Tenth session")."""

Item = tuple[list[Any], int]
"""``(parts, length)``: one page component as buffers (``memoryview`` "B") and its length."""

PROBE_PREFIX = ".probe-direct-"
"""Name prefix of the probe file; the rest is ``<host>-<pid>-...`` (:func:`~hicache_file._publish.temp_name`),
so an open can tell the probe of a killed opener from a live one's."""

_ZEROS = bytes(ALIGN)
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
OK, SHORT, CORRUPT = 0, 1, 2


class _Staging(threading.local):
    def __init__(self) -> None:
        self.buf: mmap.mmap | None = None
        self.view: memoryview | None = None
        self.sink = bytearray(ALIGN)

    def get(self, n: int) -> memoryview:
        if not n:  # every component of the run moves straight from / into the pool
            return memoryview(self.sink)[:0]
        if self.view is None or len(self.view) < n:
            if self.view is not None:
                self.view.release()
                assert self.buf is not None
                self.buf.close()
            self.buf = mmap.mmap(-1, max(DIRECT_RUN, (n + ALIGN - 1) & -ALIGN))  # page aligned
            self.view = memoryview(self.buf)
        return self.view[:n]


_staging = _Staging()


def probe_direct(dfd: int) -> str | None:
    """``None`` when ``O_DIRECT`` writes and reads work in directory ``dfd``, else why not."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    name = temp_name(PROBE_PREFIX)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
    try:
        fd = os.open(name, flags | O_DIRECT, 0o600, dir_fd=dfd)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)
        return f"open(O_DIRECT) fails: [Errno {err.errno}] {err.strerror}"
    try:
        buf = mmap.mmap(-1, ALIGN)
        try:
            buf[:8] = b"hicache!"
            if os.pwrite(fd, buf, 0) != ALIGN:
                return "a short O_DIRECT write"
            buf[:8] = bytes(8)
            if os.preadv(fd, [buf], 0) != ALIGN or buf[:8] != b"hicache!":
                return "an O_DIRECT read did not return what was written"
        finally:
            buf.close()
    except OSError as err:
        return f"O_DIRECT I/O fails: [Errno {err.errno}] {err.strerror}"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)
    return None


def open_subdir(rfd: int, name: str, root: str, fsync: bool) -> int:
    """The fd of directory ``name`` of the root (``segments/``, ``index/``), created if missing
    (with ``fsync``, its new entry synced); raises :class:`FileRootError`."""
    try:
        try:
            return open_dir(name, rfd)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=rfd)
                if fsync:
                    os.fsync(rfd)
            return open_dir(name, rfd)
    except OSError as err:
        raise FileRootError(
            f"file backend root {root!r}: cannot use {describe(err, f'{root}/{name}', name, rfd)}; "
            "remove what stands there or use another root"
        ) from None


def sweep_probes(sdir: int, max_age_s: float) -> int:
    """Remove the probe files of openers killed during :func:`probe_direct` (gone from this host,
    or older than ``max_age_s``); return how many."""
    return sweep_dir(sdir, (PROBE_PREFIX,), time.time_ns() - int(max_age_s * 1e9))


def _padded(items: Sequence[Item]) -> int:
    return sum((n + ALIGN - 1) & -ALIGN for _, n in items)


def split_runs(order: Sequence[int], sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Components ``order`` (indices into ``sizes``) cut into runs of at most ``limit`` padded
    bytes (at least one component each), back to back in that order."""
    runs: list[list[int]] = [[]]
    size = 0
    for i in order:
        n = (sizes[i] + ALIGN - 1) & -ALIGN
        if size and size + n > limit:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += n
    return runs


def _aligned(parts: list[Any]) -> bool:
    """Whether every buffer of ``parts`` starts and ends on an ``ALIGN`` boundary (then
    ``O_DIRECT`` takes it as it is)."""
    for p in parts:
        if len(p) & (ALIGN - 1):
            return False
        try:
            if ctypes.addressof(ctypes.c_char.from_buffer(p)) & (ALIGN - 1):
                return False
        except (TypeError, ValueError):  # read-only or empty: not one we can hand to the kernel
            return False
    return True


def write_run(fd: int, direct: bool, offset: int, items: Sequence[Item]) -> list[int]:
    """Write ``items`` back to back (each padded to ``ALIGN``) at ``offset``; return each
    item's xxh3_64. Raises ``OSError`` (nothing of the run may be published then)."""
    total = _padded(items)
    digests = []
    iov: list[Any] = []
    if direct:
        staged = [not _aligned(parts) for parts, _ in items]
        out = _staging.get(sum((n + ALIGN - 1) & -ALIGN for (_, n), s in zip(items, staged) if s))
        pos = 0
        for (parts, n), stage in zip(items, staged):
            if not stage:
                digests.append(fmt.checksum(parts))
                iov += parts
                continue
            start = pos
            for p in parts:
                m = len(p)
                out[pos : pos + m] = p
                pos += m
            digests.append(fmt.xxh3_64(out[start:pos]))
            pad = -n & (ALIGN - 1)
            if pad:
                out[pos : pos + pad] = _ZEROS[:pad]
                pos += pad
            iov.append(out[start:pos])
        _pwrite_all(fd, iov, offset, total)
        return digests
    for parts, n in items:
        digests.append(fmt.checksum(parts))
        iov += parts
        pad = -n & (ALIGN - 1)
        if pad:
            iov.append(_ZEROS[:pad])
    _pwrite_all(fd, iov, offset, total)
    return digests


def _pwrite_all(fd: int, iov: list[Any], offset: int, total: int) -> None:
    done = 0
    while done < total:
        n = os.pwritev(fd, iov[:MAX_IOV], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short write ({done} of {total} bytes)")
        done += n
        iov = _skip(iov, n)


def _skip(iov: list[Any], n: int) -> list[Any]:
    """``iov`` without its first ``n`` bytes."""
    out = list(iov)
    while n and out:
        first = memoryview(out[0]).cast("B")
        if n >= len(first):
            n -= len(first)
            out.pop(0)
        else:
            out[0] = first[n:]
            n = 0
    return out


def read_run(
    fd: int, direct: bool, offset: int, items: Sequence[Item], digests: Sequence[int], cached_fd: int = -1
) -> list[int]:
    """Read ``items`` laid out as :func:`write_run` wrote them; per item ``OK``, ``SHORT``
    (the segment ends before it) or ``CORRUPT`` (checksum mismatch). Only ``OK`` items hold the
    stored bytes afterwards. Raises ``OSError`` on an I/O error. With ``direct`` and a buffered
    ``cached_fd`` of the same file, what the page cache holds is read from there first."""
    total = _padded(items)
    status = []
    iov: list[Any] = []
    if direct:
        staged = [not _aligned(parts) for parts, _ in items]
        buf = _staging.get(sum((n + ALIGN - 1) & -ALIGN for (_, n), s in zip(items, staged) if s))
        pos = 0
        for (parts, n), stage in zip(items, staged):
            if stage:
                end = pos + ((n + ALIGN - 1) & -ALIGN)
                iov.append(buf[pos:end])
                pos = end
            else:
                iov += parts
        if cached_fd >= 0 and _all_cached(cached_fd, offset, total):
            fd = cached_fd
        got = _pread_all(fd, iov, offset, total)
        pos = spos = 0
        for (parts, n), digest, stage in zip(items, digests, staged):
            if pos + n > got:
                status.append(SHORT)
            elif not stage:
                status.append(OK if fmt.checksum(parts) == digest else CORRUPT)
            elif fmt.xxh3_64(buf[spos : spos + n]) != digest:
                status.append(CORRUPT)
            else:
                src = spos
                for p in parts:
                    m = len(p)
                    p[:] = buf[src : src + m]
                    src += m
                status.append(OK)
            pad = (n + ALIGN - 1) & -ALIGN
            pos += pad
            if stage:
                spos += pad
        return status
    sink = memoryview(_staging.sink)
    for parts, n in items:
        iov += parts
        pad = -n & (ALIGN - 1)
        if pad:
            iov.append(sink[:pad])
    got = _pread_all(fd, iov, offset, total)
    pos = 0
    for (parts, n), digest in zip(items, digests):
        if pos + n > got:
            status.append(SHORT)
        elif fmt.checksum(parts) != digest:
            status.append(CORRUPT)
        else:
            status.append(OK)
        pos += (n + ALIGN - 1) & -ALIGN
    return status


def _pread_all(fd: int, iov: list[Any], offset: int, total: int) -> int:
    done = 0
    while done < total and iov:
        n = os.preadv(fd, iov[:MAX_IOV], offset + done)
        if n <= 0:
            break  # end of file
        done += n
        iov = _skip(iov, n)
    return done


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_SYS_CACHESTAT = 451  # the same number on every Linux architecture
_cachestat_ok: list[bool] = []  # probed on first use


def _all_cached(fd: int, offset: int, n: int) -> bool:
    """Whether every page of ``[offset, offset + n)`` of ``fd`` is in the page cache
    (``cachestat(2)``); ``False`` where the call is missing."""
    if not has_cachestat():
        return False
    first, end = offset // mmap.PAGESIZE, (offset + n + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    rng, cs = _CacheStatRange(first * mmap.PAGESIZE, (end - first) * mmap.PAGESIZE), _CacheStat()
    assert _libc is not None
    if _libc.syscall(*_cachestat_args(fd, rng, cs)) != 0:
        return False
    return bool(cs.cache >= end - first)


def has_cachestat() -> bool:
    """Whether this kernel has ``cachestat(2)`` (Linux 6.5; not filtered by seccomp): asked once,
    with fd -1, which it refuses with ``EBADF``."""
    if not _cachestat_ok:
        ok = False
        if _libc is not None:
            rng, cs = _CacheStatRange(0, 1), _CacheStat()
            ok = _libc.syscall(*_cachestat_args(-1, rng, cs)) != 0 and ctypes.get_errno() == errno.EBADF
        _cachestat_ok.append(ok)
    return _cachestat_ok[0]


def _cachestat_args(fd: int, rng: _CacheStatRange, cs: _CacheStat) -> tuple[Any, ...]:
    return (
        ctypes.c_long(_SYS_CACHESTAT),
        ctypes.c_long(fd),
        ctypes.byref(rng),
        ctypes.byref(cs),
        ctypes.c_long(0),
    )


def run_parallel(work: Sequence[Callable[[], Any]], ex: ThreadPoolExecutor, k: int) -> list[Any]:
    """Run ``work`` in ``k`` contiguous parts, the first on the caller's thread and the others on
    ``ex``; results in order. Returns only once every part is done."""
    bounds = [len(work) * i // k for i in range(k + 1)]

    def part(lo: int, hi: int) -> list[Any]:
        return [w() for w in work[lo:hi]]

    futures: list[Future[list[Any]]] = [ex.submit(part, bounds[i], bounds[i + 1]) for i in range(1, k)]
    try:
        first = part(bounds[0], bounds[1])
    finally:  # never return while a worker still touches the caller's buffers
        rest = [f.result() for f in futures]
    out = first
    for r in rest:
        out += r
    return out


def sync_parallel(
    fd: int, data_fds: Sequence[int], dir_fds: Sequence[int], ex: ThreadPoolExecutor | None
) -> None:
    """``fdatasync`` ``fd`` and ``data_fds`` and ``fsync`` ``dir_fds``, on ``ex``'s threads and
    the caller's at once (the device merges cache flushes that overlap), or one after the other
    without ``ex``. Returns once every one is done; raises the first ``OSError``.

    The segment layout syncs a batch's data and its index records together: a record may reach
    the disk before the bytes it names, and after a power loss it then names zeros (preallocated
    blocks never written) or a torn range, which the record's checksums make a miss. Nothing is
    reported stored before all of it is durable."""
    calls = [*(partial(os.fdatasync, d) for d in data_fds), *(partial(os.fsync, d) for d in dir_fds)]
    futures: list[Future[None]] = [ex.submit(c) for c in calls] if ex is not None else []
    try:
        os.fdatasync(fd)
        if ex is None:
            for c in calls:
                c()
    finally:
        for f in futures:
            f.result()


class Seg:
    """A segment this store appends to."""

    __slots__ = ("alloc", "end", "fd", "inflight", "n", "name", "sealed")

    def __init__(self, n: int, name: str, fd: int) -> None:
        self.n, self.name, self.fd = n, name, fd
        self.end = 0
        self.alloc = 0  # bytes preallocated
        self.inflight = 0
        self.sealed = False


def close_seg(seg: Seg) -> None:
    """Close a sealed segment, cutting its unused preallocated tail."""
    try:
        if seg.alloc > seg.end:
            os.ftruncate(seg.fd, seg.end)
    except OSError:
        pass
    finally:
        os.close(seg.fd)
