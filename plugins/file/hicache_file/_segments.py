"""The segment layout of the file backend (``layout: "segments"``).

Each opened store is one *writer*: it appends the pages of a batch to its own segment file
(``segments/<writer>-<n>.seg``, all components of a page back to back, every pool of the page
together) and then one checksummed record per page to its own index log
(``index/<writer>.log``); see :mod:`hicache_file._seglog` for the format. Writers never share
a file, so several processes (TP ranks, engine instances) write one root at once with no lock
between them. Every store keeps an in-memory map ``key -> (segment, offset, length, xxh3_64)``
built by tailing every index log under the root; it looks again (one ``fstat`` per directory
and per live log, and only the new tail of a log that grew) at the start of every batch.

Guarantees, as for the ``files`` layout:

* **Atomic per page.** A page's bytes are written before its record; the record is what makes
  it visible, and a torn or damaged record is skipped on its own (the page is a miss). With
  ``fsync`` the segment and the log are ``fdatasync``\\ ed in parallel after the records are
  appended (:meth:`SegmentStore._sync_both`); the batch is reported stored only after both.
* **Checksummed.** Every read verifies each component's xxh3_64; a mismatch or a short segment
  is a miss, counted in ``integrity_errors`` and dropped from the map.
* **Never leaves the root.** Segment and log files are opened by name relative to the fds of
  ``segments/`` and ``index/`` (themselves opened with ``O_NOFOLLOW``) with ``O_NOFOLLOW``;
  a file that is not a regular file reads as a miss. Names come from our own pattern only.
* **Eviction by whole segment** under ``max_bytes``: the oldest segments (by modification time)
  are unlinked until everything under the root fits; their live pages are *dropped*, not
  rewritten (the engine writes them again if it still needs them). A store never evicts the
  segment it is appending to.
* **clear** appends a ``CLEAR`` record (every store drops the namespace's pages stored before
  it; ordering across hosts uses the wall clock) and unlinks the segments left with no live
  page that no writer appends to any more.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from ._dirs import O_CLOEXEC, O_NOFOLLOW
from ._publish import HOST
from ._segio import (
    CHUNK,
    CORRUPT,
    DIRECT_DEPTH,
    DIRECT_RUN,
    O_DIRECT,
    OK,
    Seg,
    close_seg,
    open_subdir,
    probe_direct,
    read_run,
    run_parallel,
    split_runs,
    sweep_probes,
    sync_parallel,
    write_run,
)
from ._seglog import (
    HEADER_SIZE,
    INDEX_DIR,
    LOG_SUFFIX,
    SEG_DIR,
    SEG_SUFFIX,
    align,
    clear_record,
    header,
    put_record,
    seed,
    seg_name,
)
from ._segmap import SegIndex

if TYPE_CHECKING:
    from ._options import FileOptions
    from ._stats import FileStats

__all__ = ["SegmentStore"]

log = logging.getLogger("hicache.file")

SEG_BYTES = 1 << 30
"""A writer starts a new segment once its current one holds this much; under ``max_bytes``,
``max_bytes / 16`` when that is smaller (at least ``SEG_MIN``): eviction frees whole segments, and
a store never evicts the one it appends to."""

SEG_MIN = 64 << 10
"""The smallest segment target (a ``max_bytes`` under 1 MiB): smaller would be one file per page."""

MEASURE_SHARE = 8
"""A store lists the root again (and evicts) once it has added ``max_bytes / MEASURE_SHARE`` bytes
since its last listing: other stores' writes are seen then, so N stores writing one root at once
overshoot the budget by ``N * max_bytes / MEASURE_SHARE`` at most, plus a preallocation step and a
batch each (``plugins/file/README.md``, "max_bytes" under "Segment layout")."""


LOG_MAX = 64 << 20
"""Past this size a writer's log is rotated: the store seals its segment and goes on as a new
writer id; the old log is removed with the last of its segments (kept if it holds a CLEAR)."""

PREALLOC = 128 << 20
"""Segments grow by preallocated steps (``posix_fallocate``); the unused tail is cut when the
segment is sealed; a killed writer's is cut by the next store opened on the root on this host
(:meth:`~hicache_file._segmap.SegIndex.trim_gone_writers`)."""


class SegmentStore(SegIndex):
    """Pages of one root in segment files (see the module docstring)."""

    def __init__(
        self,
        root: str,
        rfd: int,
        options: FileOptions,
        stats: FileStats,
        stats_lock: threading.Lock,
        executor: Callable[[], ThreadPoolExecutor | None],
        root_fd: Callable[[], int] | None = None,
    ) -> None:
        self._fsync = options.fsync
        self._max = options.max_bytes
        self._threads, self._min_par = options.io_threads, options.parallel_min_bytes
        self._executor = executor
        self._stats, self._stats_lock = stats, stats_lock
        self._seg_target = SEG_BYTES if self._max is None else max(SEG_MIN, min(SEG_BYTES, self._max // 16))
        sdir = open_subdir(rfd, SEG_DIR, root, options.fsync)
        try:
            idir = open_subdir(rfd, INDEX_DIR, root, options.fsync)
        except BaseException:
            os.close(sdir)
            raise
        swept = sweep_probes(sdir, options.temp_max_age_s)
        with stats_lock:
            stats.temp_files_removed += swept
        why = probe_direct(sdir) if options.direct_io else "direct_io is off"
        if options.direct_io and why is not None:
            log.info("hicache.file: %s/%s: no O_DIRECT (%s); segments use buffered I/O", root, SEG_DIR, why)
        writer, auto = f"{HOST or 'x'}-{os.getpid()}-{secrets.token_hex(4)}", options.direct_io == "auto"
        super().__init__(root, sdir, idir, writer, why is None, auto, options.fsync, root_fd)
        self._seed = seed(self.writer)
        self._log_fd = -1
        self._wlock = threading.Lock()  # own segment / log
        self._cur: Seg | None = None
        self._next_n = 0
        self._approx = 0  # bytes under the root at the last listing
        self._grown = 0  # bytes this store added to its files since the last listing (_wlock)
        self._evict_lock = threading.Lock()
        self._log_made = False
        self._log_bytes = 0
        self._log_clears = False  # the current log holds a CLEAR record
        self._pending = 0  # batches between reserving their range and appending their records
        self._dirty_dirs: set[int] = set()  # directories with a new entry not yet fsynced
        self.refresh()
        self.trim_gone_writers()
        if self._max is not None:
            self._evict()

    def _current(self) -> str | None:
        cur = self._cur
        return cur.name if cur is not None else None

    # ---------------------------------------------------------------- batches
    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.refresh()
        m = self._map
        return [k in m for k in keys]

    def _parallel(self, work: Sequence[Callable[[], Any]], nbytes: int, direct: bool) -> list[Any]:
        """Run ``work`` on the caller's thread and the pool's (``DIRECT_DEPTH`` at once for
        ``direct`` I/O); results in order."""
        ex = self._executor() if len(work) > 1 and self._threads > 1 and nbytes >= self._min_par else None
        if ex is None:
            return [w() for w in work]
        return run_parallel(
            work, ex, min(max(self._threads, DIRECT_DEPTH) if direct else self._threads, len(work))
        )

    def get(
        self, keys: Sequence[str], iovs: list[list[Any]], sizes: list[int], posts: list[Any] | None
    ) -> tuple[list[bool], dict[str, int]]:
        self.refresh()
        n = len(keys)
        ok = [False] * n
        counts = {"misses": 0, "size_mismatches": 0, "integrity_errors": 0, "read_errors": 0}
        wanted: list[tuple[str, int, int, int, int]] = []  # seg, offset, length, digest, i
        for i, k in enumerate(keys):
            loc = self._map.get(k)
            if loc is None:
                counts["misses"] += 1
            elif loc[2] != sizes[i]:
                counts["size_mismatches"] += 1
            else:
                wanted.append((loc[0], loc[1], loc[2], loc[3], i))
        wanted.sort()
        runs: list[list[tuple[str, int, int, int, int]]] = []
        limit = DIRECT_RUN if self.direct else CHUNK
        for w in wanted:
            last = runs[-1][-1] if runs else None
            if (
                last is not None
                and last[0] == w[0]
                and last[1] + align(last[2]) == w[1]
                and w[1] + w[2] - runs[-1][0][1] <= limit
            ):
                runs[-1].append(w)
            else:
                runs.append([w])
        self._enter()
        try:
            fds: dict[str, tuple[int, int] | OSError] = {}
            for run in runs:
                seg = run[0][0]
                if seg not in fds:
                    try:
                        fds[seg] = self._seg_fd(seg)
                    except OSError as err:
                        fds[seg] = err
            work = [partial(self._read, run, fds[run[0][0]], iovs) for run in runs]
            results = self._parallel(work, sum(w[2] for w in wanted), self.direct)
        finally:
            self._leave()
        bad: list[tuple[str, str]] = []
        nbytes = 0
        for run, res in zip(runs, results):
            for w, st in zip(run, res):
                key = keys[w[4]]
                if st == OK:
                    ok[w[4]] = True
                    nbytes += w[2]
                    if posts is not None and posts[w[4]] is not None:
                        dst, scratch = posts[w[4]]
                        dst.copy_(scratch.view(dst.shape))
                elif isinstance(st, OSError):
                    counts["read_errors"] += 1
                    if st.errno == errno.ENOENT:  # evicted meanwhile: a plain miss
                        counts["read_errors"] -= 1
                        counts["misses"] += 1
                    bad.append((key, str(st)))
                else:
                    counts["integrity_errors"] += 1
                    bad.append(
                        (key, "checksum mismatch" if st == CORRUPT else "segment ends before the page")
                    )
        if bad:
            with self._lock:
                for key, _ in bad:
                    loc = self._map.get(key)
                    if loc is not None:
                        del self._map[key]  # the next backup writes it again
            if counts["integrity_errors"] or counts["read_errors"]:
                log.warning(
                    "hicache.file: %d of %d pages unreadable under %s (misses; written again by the next "
                    "backup); first: %s: %s",
                    len(bad),
                    n,
                    self.root,
                    *bad[0],
                )
        counts["hits"] = ok.count(True)
        counts["bytes_read"] = nbytes
        return ok, counts

    def _read(
        self, run: list[tuple[str, int, int, int, int]], fd: tuple[int, int] | OSError, iovs: list[list[Any]]
    ) -> list[Any]:
        if isinstance(fd, OSError):
            return [fd] * len(run)
        items = [([memoryview(p).cast("B") for p in iovs[w[4]]], w[2]) for w in run]
        try:
            return read_run(fd[0], self.direct, run[0][1], items, [w[3] for w in run], fd[1])
        except OSError as err:
            return [err] * len(run)

    # ----------------------------------------------------------------- writes
    def _open_log(self) -> int:
        if self._log_fd < 0:
            name = self.writer + ".log"
            flags = os.O_WRONLY | os.O_APPEND | O_NOFOLLOW | O_CLOEXEC
            if self._log_made:  # opened again after close()
                self._log_fd = os.open(name, flags, dir_fd=self._idir)
                return self._log_fd
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=self._idir)
            try:
                os.write(fd, header(self.writer))
                if self._fsync:
                    self._dirty_dirs.add(self._idir)  # synced with the first records
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._idir)
                raise
            self._log_fd = fd
            self._log_made = True
            self._log_bytes = HEADER_SIZE
            self._grown += HEADER_SIZE
        return self._log_fd

    def _reserve(self, nbytes: int) -> tuple[Seg, int]:
        with self._wlock:
            cur = self._cur
            if cur is not None and (cur.end >= self._seg_target or os.fstat(cur.fd).st_nlink == 0):
                self._seal(cur)
                cur = None
            if cur is None:
                n = self._next_n
                self._next_n += 1
                name = seg_name(self.writer, n)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
                fd = os.open(name, flags | (O_DIRECT if self.direct_write else 0), 0o644, dir_fd=self._sdir)
                if self._fsync:
                    self._dirty_dirs.add(self._sdir)  # synced with the first records naming it
                cur = self._cur = Seg(n, name, fd)
                with self._lock:
                    self._by_seg.setdefault(name, [])
            off = cur.end
            size = max(cur.end, cur.alloc)
            cur.end += nbytes
            if cur.end > cur.alloc:  # O_DIRECT writes into allocated blocks run 7-15 % faster
                step = max(cur.end - cur.alloc, min(PREALLOC, self._seg_target))
                with contextlib.suppress(OSError):  # best effort: a full disk fails the writes themselves
                    os.posix_fallocate(cur.fd, cur.alloc, step)
                    cur.alloc += step
            self._grown += max(cur.end, cur.alloc) - size
            cur.inflight += 1
            self._pending += 1
            return cur, off

    def _rotate(self) -> None:  # with self._wlock held
        if self._cur is not None:
            self._seal(self._cur)
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1
        with self._lock:
            (self._kept if self._log_clears else self._rotated).add(self.writer + LOG_SUFFIX)
            self.writer = f"{HOST or 'x'}-{os.getpid()}-{secrets.token_hex(4)}"
        self._seed = seed(self.writer)
        self._next_n, self._log_made, self._log_bytes, self._log_clears = 0, False, 0, False

    def _seal(self, seg: Seg) -> None:  # with self._wlock held
        seg.sealed = True
        if self._cur is seg:
            self._cur = None
        if not seg.inflight:
            close_seg(seg)

    def _done(self, seg: Seg) -> None:
        with self._wlock:
            seg.inflight -= 1
            self._pending -= 1
            if seg.sealed and not seg.inflight:
                close_seg(seg)

    def set(
        self, keys: Sequence[str], iovs: list[list[Any]], sizes: list[int], groups: list[list[int]]
    ) -> tuple[list[bool], dict[str, int]]:
        """Write the pages not stored yet; ``groups``: indices of each page's components."""
        self.refresh()
        n = len(keys)
        ok = [False] * n
        m = self._map
        seen: set[str] = set()
        todo: list[list[int]] = []
        skipped = 0
        for g in groups:
            part = []
            for i in g:
                k = keys[i]
                if k in m:
                    ok[i] = True
                    skipped += 1
                elif k not in seen:
                    seen.add(k)
                    part.append(i)
            if part:
                todo.append(part)
        counts = {"skipped_writes": skipped, "writes": 0, "bytes_written": 0, "write_errors": 0}
        if not todo:
            return ok, counts
        # a page's components may span runs: its record is written only if all of them were
        runs = split_runs([i for g in todo for i in g], sizes, DIRECT_RUN if self.direct_write else CHUNK)
        total = sum(align(sizes[i]) for g in todo for i in g)
        try:
            seg, base = self._reserve(total)
        except OSError as err:
            return self._failed(ok, todo, counts, err, keys)
        try:
            starts = []
            off = base
            for r in runs:
                starts.append(off)
                off += sum(align(sizes[i]) for i in r)
            work = [partial(self._write, seg.fd, o, r, iovs, sizes) for r, o in zip(runs, starts)]
            digests: list[int | None] = []
            first_err: OSError | None = None
            for r, res in zip(runs, self._parallel(work, total, self.direct_write)):
                if isinstance(res, OSError):
                    first_err = first_err or res
                    res = [None] * len(r)
                digests += res
            recs: list[bytes] = []
            done: list[tuple[int, list[tuple[str, int, int]]]] = []
            t = time.time_ns()
            it, o = iter(digests), base
            for g in todo:
                got = [next(it) for _ in g]
                if None in got:
                    counts["write_errors"] += len(g)
                else:
                    entries = [(keys[i], sizes[i], d) for i, d in zip(g, got) if d is not None]
                    recs.append(put_record(self._seed, seg.n, t, o, entries))
                    done.append((o, entries))
                o += sum(align(sizes[i]) for i in g)
            if recs:
                try:
                    with self._wlock:
                        lfd = self._open_log()
                        data = b"".join(recs)
                        if os.write(lfd, data) != len(data):
                            raise OSError(errno.ENOSPC, "short write to the index log")
                        if self._fsync:
                            self._sync_both(seg.fd, lfd)
                        self._log_bytes += len(data)
                        self._grown += len(data)
                        if self._log_bytes > LOG_MAX and self._pending == 1:  # no other batch between
                            self._rotate()  # its reservation and its records: none names this writer
                except OSError as err:
                    first_err = first_err or err
                    counts["write_errors"] += sum(len(e) for _, e in done)
                    done = []
        finally:
            self._done(seg)
        with self._lock:
            for o, entries in done:
                self._apply_put(seg.name, o, t, entries)
        for _, entries in done:
            for _key, length, _ in entries:
                counts["writes"] += 1
                counts["bytes_written"] += length
        for i, k in enumerate(keys):
            if not ok[i] and k in m:
                ok[i] = True
        if first_err is not None:
            self._log_write_error(counts["write_errors"], n, first_err)
        if self._max is not None:
            grown = self._grown
            if self._approx + grown > self._max or grown >= self._max // MEASURE_SHARE:
                self._evict()
        return ok, counts

    def _sync_both(self, seg_fd: int, log_fd: int) -> None:
        """Make a batch durable: the segment's data, the log's records, and the directory entries
        of a segment or log created since the last sync (see :func:`sync_parallel`)."""
        dirs = list(self._dirty_dirs)
        sync_parallel(log_fd, [seg_fd], dirs, self._executor() if self._threads > 1 else None)
        self._dirty_dirs.difference_update(dirs)

    def _write(self, fd: int, offset: int, run: list[int], iovs: list[list[Any]], sizes: list[int]) -> Any:
        items = [([memoryview(p).cast("B") for p in iovs[i]], sizes[i]) for i in run]
        try:
            return write_run(fd, self.direct_write, offset, items)
        except OSError as err:
            return err

    def _failed(
        self, ok: list[bool], todo: list[list[int]], counts: dict[str, int], err: OSError, keys: Sequence[str]
    ) -> tuple[list[bool], dict[str, int]]:
        counts["write_errors"] += sum(len(g) for g in todo)
        self._log_write_error(counts["write_errors"], len(keys), err)
        return ok, counts

    def _log_write_error(self, failed: int, n: int, err: OSError) -> None:
        msg = "hicache.file: %d of %d set operations failed under %s (those keys report False); first: "
        log.warning(msg + "[Errno %s] %s", failed, n, self.root, err.errno, err.strerror or err)

    # -------------------------------------------------------- clear / evict
    def clear(self, prefix: str) -> int:
        self.refresh()
        t = time.time_ns()
        try:
            with self._wlock:
                lfd = self._open_log()
                rec = clear_record(self._seed, t, prefix)
                self._log_clears = True
                if os.write(lfd, rec) != len(rec):
                    raise OSError(errno.ENOSPC, "short write to the index log")
                self._log_bytes += len(rec)
                self._grown += len(rec)
                if self._fsync:
                    os.fdatasync(lfd)
                    if self._idir in self._dirty_dirs:  # the log was just created
                        os.fsync(self._idir)
                        self._dirty_dirs.discard(self._idir)
        except OSError as err:
            # Unrecorded, the clear would hold in this store only, and every other or later store
            # would still serve the pages: fail it, and keep serving them here too (still true).
            raise OSError(
                err.errno,
                f"clear could not be recorded in the index log under {self.root} ({err.strerror or err}); "
                "nothing was cleared: free disk space and clear again",
            ) from err
        with self._lock:
            removed = self._apply_clear(prefix, t)
        self._reclaim()
        return removed

    def _reclaim(self) -> None:
        """Unlink sealed segments left with no live page (this store's own segment too, when no
        write is in flight in it: the next write starts a new one)."""
        with self._wlock:
            cur = self._cur
            if cur is not None and not cur.inflight:
                with self._lock:
                    live = any(self._map.get(k, ("",))[0] == cur.name for k in self._by_seg.get(cur.name, ()))
                if not live:
                    self._seal(cur)
        with self._lock:
            dead = [
                s
                for s, ks in self._by_seg.items()
                if self._sealed(s) and not any(self._map.get(k, ("",))[0] == s for k in ks)
            ]
            for s in dead:
                self._drop_seg(s)
        for s in dead:
            with contextlib.suppress(OSError):
                os.unlink(s, dir_fd=self._sdir)

    def _evict(self) -> None:
        """Unlink the oldest segments until everything under the root fits ``max_bytes``."""
        assert self._max is not None
        with self._evict_lock:
            with self._wlock:
                self._grown = 0
            segs = []
            total = 0
            for dfd in (self._sdir, self._idir):
                with os.scandir(dfd) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        total += st.st_size
                        if dfd == self._sdir and e.name.endswith(SEG_SUFFIX) and stat.S_ISREG(st.st_mode):
                            segs.append((st.st_mtime_ns, e.name, st.st_size))
            self._approx = total
            if total <= self._max:
                return
            segs.sort()
            cur = self._cur.name if self._cur is not None else None
            pages = nbytes = 0
            for _, name, size in segs:
                if total <= self._max:
                    break
                if name == cur:
                    continue
                try:
                    os.unlink(name, dir_fd=self._sdir)
                except FileNotFoundError:
                    pass
                except OSError as err:
                    log.warning("hicache.file: cannot evict %s/%s/%s: %s", self.root, SEG_DIR, name, err)
                    continue
                total -= size
                nbytes += size
                with self._lock:
                    pages += self._drop_seg(name)
            self._approx = total - self._drop_dead_logs()
        with self._stats_lock:
            self._stats.evictions += pages
            self._stats.evicted_bytes += nbytes
        log.debug("hicache.file: evicted %d pages (%d bytes of segments) to fit max_bytes", pages, nbytes)

    def close(self) -> None:
        """Seal the segment being written and close every file and directory (a closed store
        still answers, opening what it needs again)."""
        with self._wlock:
            if self._cur is not None:
                self._seal(self._cur)
            if self._log_fd >= 0:
                os.close(self._log_fd)
                self._log_fd = -1
            for dfd in self._dirty_dirs:  # a batch that failed after creating a file
                with contextlib.suppress(OSError):
                    os.fsync(dfd)
            self._dirty_dirs.clear()
        with self._lock:
            for lg in self._logs.values():
                if lg.fd >= 0:
                    os.close(lg.fd)
                    lg.fd = -1
            for fd in self._fds.values():
                self._retire(fd)
            self._fds.clear()
        self.close_dirs()
