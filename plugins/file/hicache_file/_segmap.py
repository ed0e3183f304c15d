"""The reader side of the segment layout: the map ``key -> location``, built by tailing logs.

:class:`SegIndex` is the base of :class:`hicache_file._segments.SegmentStore`. It reads every
other writer's index log under ``index/`` (see :mod:`hicache_file._seglog`), from where it
stopped, applies the ``PUT`` and ``CLEAR`` records, and forgets the pages of segments that are
gone (evicted or reclaimed, here or by another process). :meth:`SegIndex.refresh` costs one
``fstat`` per directory and per log still written when nothing changed; a directory is listed
again only when its mtime moved or is recent (mtime ticks are coarse). Read fds of segments are
cached and closed only when no batch is running, so an fd number is never reused under a thread
still reading it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from operator import countOf

from hicache_core import KeyFormatError, check_key, check_keys

from ._dirs import O_CLOEXEC, O_NOFOLLOW, DirTree, open_dir
from ._publish import _writer_gone
from ._segio import O_DIRECT, has_cachestat
from ._seglog import (
    CLEAR,
    HEADER_SIZE,
    INDEX_DIR,
    LOG_SUFFIX,
    SEG_DIR,
    SEG_SUFFIX,
    align,
    header,
    parse_log_name,
    replay,
    seed,
    seg_name,
)

__all__ = ["Loc", "SegIndex", "check_key_batch", "close_all", "page_groups"]

log = logging.getLogger("hicache.file")

_RECENT_NS = 2_000_000_000  # a directory changed this recently is listed again (mtime ticks are coarse)
RFLAGS = os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
_MAX_FDS = 256

Loc = tuple[str, int, int, int, int]
"""``(segment name, offset, length, xxh3_64, time_ns)`` of one stored key."""


class _Log:
    """Another writer's index log, as far as it was read."""

    __slots__ = ("clears", "fd", "final", "last_seg", "name", "pos", "seed", "size", "writer")

    def __init__(self, name: str, writer: str) -> None:
        self.name, self.writer = name, writer
        self.fd = -1
        self.pos = 0  # bytes consumed (0: header not checked yet)
        self.size = -1
        self.seed = seed(writer)
        self.final = False  # its writer is gone and it was read to the end
        self.last_seg = -1
        self.clears = False  # it holds a CLEAR record: kept for good (see _drop_dead_logs)


class SegIndex:
    """The map of every stored key, and the read fds of segments (module docstring)."""

    def __init__(
        self,
        root: str,
        sdir: int,
        idir: int,
        writer: str,
        direct: bool,
        auto: bool = False,
        durable: bool = True,
        root_fd: Callable[[], int] | None = None,
    ) -> None:
        self.root = root
        self._dirs = (sdir, idir)  # -1, -1 once closed: opened again on use, through root_fd()
        self._root_fd = root_fd
        self.writer = writer
        self.direct = direct  # O_DIRECT reads
        self.cached = direct and auto and has_cachestat()  # reads take cached runs from the page cache
        # "auto": buffered writes without fsync, when cached pages can be read back from the cache
        self.direct_write = direct and (durable or not self.cached)
        self._lock = threading.RLock()  # the map, the logs, the fd cache
        self._map: dict[str, Loc] = {}
        self._by_seg: dict[str, list[str]] = {}
        self._logs: dict[str, _Log] = {}
        self._clears: dict[str, int] = {}
        self._fds: dict[str, tuple[int, int]] = {}  # segment -> (read fd, buffered fd or -1)
        self._retired: list[int] = []
        self._users = 0
        self._seen = [0, 0]  # mtime_ns of index/ and segments/ when last listed
        self._ends: dict[str, int] = {}  # segment -> end of its last recorded page
        self._rotated: set[str] = set()  # own logs of earlier writer ids (rotated), removable
        self._kept: set[str] = set()  # own logs of earlier writer ids that hold a CLEAR record

    def _current(self) -> str | None:
        """The segment this store appends to (never forgotten, never evicted)."""
        return None

    def close(self) -> None:
        """Close every file this store holds open (not its directories)."""

    def dir_fds(self) -> tuple[int, int]:
        """The fds of ``segments/`` and ``index/`` (-1 when closed; see :meth:`close_dirs`)."""
        return self._dirs

    @property
    def _sdir(self) -> int:
        fd = self._dirs[0]
        return fd if fd >= 0 else self._reopen_dirs()[0]

    @property
    def _idir(self) -> int:
        fd = self._dirs[1]
        return fd if fd >= 0 else self._reopen_dirs()[1]

    def _reopen_dirs(self) -> tuple[int, int]:
        """Open ``segments/`` and ``index/`` again (a closed store still answers)."""
        with self._lock:
            if self._dirs[0] < 0:
                if self._root_fd is None:
                    raise OSError(errno.EBADF, f"the segment store under {self.root} is closed")
                rfd = self._root_fd()
                sdir = open_dir(SEG_DIR, rfd)
                try:
                    idir = open_dir(INDEX_DIR, rfd)
                except BaseException:
                    os.close(sdir)
                    raise
                self._dirs = (sdir, idir)
            return self._dirs

    def close_dirs(self) -> None:
        """Close the directory fds once no batch runs (:meth:`_enter`); opened again on use."""
        with self._lock:
            dirs, self._dirs = self._dirs, (-1, -1)
            self._retire(dirs)

    def refresh(self) -> None:
        """Read what other writers appended, and forget pages of segments that are gone."""
        with self._lock:
            now = time.time_ns()
            st = os.fstat(self._idir)
            if st.st_mtime_ns != self._seen[0] or now - st.st_mtime_ns < _RECENT_NS:
                self._seen[0] = st.st_mtime_ns
                with os.scandir(self._idir) as it:
                    names = [e.name for e in it]
                for name in names:
                    writer = parse_log_name(name)
                    own = name in self._rotated or name in self._kept
                    if writer is not None and writer != self.writer and name not in self._logs and not own:
                        self._logs[name] = _Log(name, writer)
                listed = set(names)
                for name in [n for n in self._logs if n not in listed]:  # removed (names are never reused)
                    lg = self._logs.pop(name)
                    if lg.fd >= 0:
                        os.close(lg.fd)
            for lg in list(self._logs.values()):
                if not lg.final:
                    self._tail(lg)
            st = os.fstat(self._sdir)
            if st.st_mtime_ns != self._seen[1] or now - st.st_mtime_ns < _RECENT_NS:
                self._seen[1] = st.st_mtime_ns
                with os.scandir(self._sdir) as it:
                    present = {e.name for e in it}
                cur = self._current()
                for seg in [s for s in self._by_seg if s not in present and s != cur]:
                    self._drop_seg(seg)

    def _tail(self, lg: _Log) -> None:
        if lg.fd < 0:
            try:
                fd = os.open(lg.name, RFLAGS, dir_fd=self._idir)
            except FileNotFoundError:
                del self._logs[lg.name]
                return
            except OSError as err:
                log.warning(
                    "hicache.file: cannot read index log %s/%s/%s: %s", self.root, INDEX_DIR, lg.name, err
                )
                lg.final = True
                return
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                log.warning(
                    "hicache.file: %s/%s/%s is not a regular file; ignored", self.root, INDEX_DIR, lg.name
                )
                lg.final = True
                return
            lg.fd = fd
        size = os.fstat(lg.fd).st_size
        if size == lg.size:
            if _writer_gone(lg.writer):  # nothing more will come: stop looking at it
                lg.final = True
                os.close(lg.fd)
                lg.fd = -1
            return
        lg.size = size
        if lg.pos == 0:
            if size < HEADER_SIZE:
                return
            if os.pread(lg.fd, HEADER_SIZE, 0) != header(lg.writer):
                # Each record verifies on its own against the writer id of the log's *name*,
                # so a damaged header costs nothing: the records after it are read as usual.
                log.warning(
                    "hicache.file: index log %s/%s/%s has a damaged header; its records are still "
                    "checked one by one",
                    self.root,
                    INDEX_DIR,
                    lg.name,
                )
            lg.pos = HEADER_SIZE
        data = os.pread(lg.fd, size - lg.pos, lg.pos)
        rep = replay(data, lg.seed)
        lg.pos += rep.consumed
        if rep.damaged:
            log.warning(
                "hicache.file: index log %s/%s/%s: %d damaged records skipped (their pages are misses)",
                self.root,
                INDEX_DIR,
                lg.name,
                rep.damaged,
            )
        for rec in rep.records:
            if rec.kind == CLEAR:
                lg.clears = True
                self._apply_clear(rec.entries[0][0], rec.time_ns)
            else:
                lg.last_seg = max(lg.last_seg, rec.seg)
                self._apply_put(seg_name(lg.writer, rec.seg), rec.offset, rec.time_ns, rec.entries)

    def _apply_put(
        self, seg: str, offset: int, time_ns: int, entries: Sequence[tuple[str, int, int]]
    ) -> None:
        keys = self._by_seg.setdefault(seg, [])
        clears, known = self._clears, self._map
        for key, length, digest in entries:
            # The newest record of a key wins, whatever order the logs are read in: a page
            # rewritten after damage or the loss of its segment must not be shadowed by its
            # older record in another writer's log.
            old = known.get(key)
            if (old is None or old[4] <= time_ns) and not (
                clears and any(key.startswith(p) and time_ns < t for p, t in clears.items())
            ):
                known[key] = (seg, offset, length, digest, time_ns)
                keys.append(key)
            offset += align(length)
        if offset > self._ends.get(seg, 0):
            self._ends[seg] = offset

    def _apply_clear(self, prefix: str, time_ns: int) -> int:
        if self._clears.get(prefix, 0) < time_ns:
            self._clears[prefix] = time_ns
        gone = [k for k, loc in self._map.items() if k.startswith(prefix) and loc[4] < time_ns]
        for k in gone:
            del self._map[k]
        return len(gone)

    def _drop_seg(self, seg: str) -> int:
        """Forget the pages of segment ``seg`` (gone); return how many were live."""
        n = 0
        self._ends.pop(seg, None)
        for key in self._by_seg.pop(seg, ()):
            loc = self._map.get(key)
            if loc is not None and loc[0] == seg:
                del self._map[key]
                n += 1
        fds = self._fds.pop(seg, None)
        if fds is not None:
            self._retire(fds)
        return n

    def _retire(self, fds: tuple[int, int]) -> None:  # with self._lock held
        for fd in fds:
            if fd >= 0 and self._users:
                self._retired.append(fd)
            elif fd >= 0:
                os.close(fd)

    def _enter(self) -> None:
        with self._lock:
            self._users += 1

    def _leave(self) -> None:
        with self._lock:
            self._users -= 1
            fds: list[int] = []
            if not self._users:
                fds, self._retired = self._retired, []
        for fd in fds:
            os.close(fd)

    def _seg_fd(self, seg: str) -> tuple[int, int]:
        """The read fd of segment ``seg`` and, when reads try the page cache first, a buffered
        fd of the same file (else -1); cached; raises ``OSError``."""
        fds = self._fds.get(seg)
        if fds is not None:
            return fds
        fd = os.open(seg, RFLAGS | (O_DIRECT if self.direct else 0), dir_fd=self._sdir)
        bfd = -1
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", f"{self.root}/{SEG_DIR}/{seg}")
            if self.cached:
                bfd = os.open(seg, RFLAGS, dir_fd=self._sdir)
                bst = os.fstat(bfd)
                if (bst.st_dev, bst.st_ino) != (st.st_dev, st.st_ino):  # replaced in between
                    raise OSError(
                        errno.ESTALE, "segment replaced while opened", f"{self.root}/{SEG_DIR}/{seg}"
                    )
        except BaseException:
            os.close(fd)
            if bfd >= 0:
                os.close(bfd)
            raise
        with self._lock:
            if len(self._fds) >= _MAX_FDS:
                for old in self._fds.values():
                    self._retire(old)
                self._fds.clear()
            self._fds[seg] = (fd, bfd)
        return fd, bfd

    def _drop_dead_logs(self) -> int:
        """Unlink the logs of writers that are gone and whose segments are all gone; return the
        bytes freed. A log holding a CLEAR record stays: other writers' segments may still hold
        pages older than the clear, and a store opened later must apply it to them."""
        freed = 0
        with self._lock:
            for name, lg in list(self._logs.items()):
                prefix = lg.writer + "-"
                if lg.clears or not lg.final or any(s.startswith(prefix) for s in self._by_seg):
                    continue
                try:
                    os.unlink(name, dir_fd=self._idir)
                except OSError:
                    continue
                del self._logs[name]
                freed += max(lg.size, 0)
            for name in list(self._rotated):  # this store's own rotated logs, same rule
                prefix = name[: -len(LOG_SUFFIX)] + "-"
                if any(s.startswith(prefix) for s in self._by_seg):
                    continue
                try:
                    size = os.stat(name, dir_fd=self._idir, follow_symlinks=False).st_size
                    os.unlink(name, dir_fd=self._idir)
                except OSError:
                    continue
                self._rotated.discard(name)
                freed += size
        return freed

    def trim_gone_writers(self) -> int:
        """Cut what writers that are gone from this host left past their last recorded page:
        the preallocated tail of their last segment, and segments no record names (unlinked).
        Return the bytes freed. Each log is read to its end *after* its writer is known gone,
        so nothing it recorded is cut."""
        freed = 0
        with self._lock:
            with os.scandir(self._sdir) as it:
                segs = [e.name for e in it if e.name.endswith(SEG_SUFFIX)]
            gone: dict[str, bool] = {}
            for seg in segs:
                writer = seg[: -len(SEG_SUFFIX)].rpartition("-")[0]
                if writer == self.writer or parse_log_name(writer + ".log") is None:
                    continue
                if writer not in gone:
                    gone[writer] = _writer_gone(writer)
                    name = writer + ".log"
                    if gone[writer] and name not in self._logs:  # made after index/ was listed?
                        self._logs[name] = _Log(name, writer)
                    lg = self._logs.get(name)
                    if gone[writer] and lg is not None and not lg.final:
                        self._tail(lg)  # it appends no more: this read is complete (or no log)
                if gone[writer]:
                    freed += self._trim(seg, self._ends.get(seg, 0))
        return freed

    def _trim(self, seg: str, end: int) -> int:  # with self._lock held
        try:
            fd = os.open(seg, os.O_WRONLY | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK, dir_fd=self._sdir)
        except OSError:
            return 0
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size <= end:
                return 0
            if end == 0:
                os.unlink(seg, dir_fd=self._sdir)
                return int(st.st_size)
            os.ftruncate(fd, end)
            return int(st.st_size - end)
        except OSError:
            return 0
        finally:
            os.close(fd)

    def _sealed(self, seg: str) -> bool:
        """No writer appends to ``seg`` any more."""
        if seg.startswith(self.writer + "-"):
            return self._current() != seg
        if seg.rpartition("-")[0] + LOG_SUFFIX in self._rotated | self._kept:
            return True  # this store's own, from before a log rotation
        writer, _, n = seg[: -len(SEG_SUFFIX)].rpartition("-")
        lg = self._logs.get(writer + ".log")
        return lg is None or lg.final or _writer_gone(writer) or lg.last_seg > int(n)


_VALID_MAX = 1 << 15


def check_key_batch(keys: Sequence[str], valid: set[str]) -> None:
    """Refuse (:class:`KeyFormatError`) any key that is not an exact ``str`` passing
    :func:`hicache_core.check_key`; keys seen valid before are remembered in ``valid`` (bounded)."""
    if countOf(map(type, keys), str) != len(keys):
        for k in keys:
            check_key(k)  # raises for the first key that is not an exact str
        raise KeyFormatError("storage keys must be exact str objects")  # pragma: no cover
    new = [k for k in keys if k not in valid]
    if new:
        check_keys(new)
        if len(valid) + len(new) > _VALID_MAX:
            valid.clear()
        valid.update(new)


def page_groups(keys: Sequence[str], shape: list[tuple[int, int]] | None) -> list[list[int]]:
    """Indices of ``keys`` grouped by page: one index record (one atomic unit) per group.

    ``shape`` (v2): ``(pages, components)`` per transfer, keys concatenated transfer by
    transfer; page ``j`` of every transfer forms one group (every pool of the page together).
    Without it (v1, one pool): consecutive keys ending in the same page hash form a group.
    """
    if shape is not None:
        groups: list[list[int]] = []
        off = 0
        for n, c in shape:
            for j in range(n):
                if j == len(groups):
                    groups.append([])
                groups[j].extend(range(off + j * c, off + (j + 1) * c))
            off += n * c
        return [g[i : i + 255] for g in groups for i in range(0, len(g), 255)]  # 255 entries per record
    out: list[list[int]] = []
    last = None
    for i, k in enumerate(keys):
        tail = k[k.rfind(".") + 1 :]
        if tail == last and len(out[-1]) < 255:
            out[-1].append(i)
        else:
            out.append([i])
            last = tail
    return out


def close_all(tree: DirTree, store: SegIndex) -> None:
    """Finalizer of a segment-layout backend: every file it holds, its directories, the root."""
    with contextlib.suppress(OSError):
        store.close()
    for fd in store.dir_fds():
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    tree.close()
