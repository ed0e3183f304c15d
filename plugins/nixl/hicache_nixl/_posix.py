"""The POSIX side: the objects of each batch in one segment file, found through an index log.

Layout under ``root``::

    index.log                  the index (:mod:`hicache_nixl._index`), appended by every store
    <shard>/<writer>-<n>       segments: one per batch, written once by NIXL, never reused

``<writer>`` is ``<host>-<pid>-<token>`` (host: 8 hex digits of the host name; token: random,
per opened store), so a segment name is never reused: a stale entry can only point at a
missing file, never at other bytes. ``<shard>`` (256 directories, two hex digits of the
segment name's xxh3) keeps every directory small.

* **Atomic per key.** NIXL writes the objects of a batch into a new segment (each at a 4 KiB
  boundary, straight from registered pool memory); only then is the batch's index record
  appended, and the record is what makes its keys visible. A killed writer leaves a segment no
  record names (removed at the next open: at once for this host's dead PIDs, after an hour
  otherwise) or a torn record (skipped).
* **Checked reads.** Each entry carries the object's length and xxh3_64; a read is reported only
  when NIXL finished it and the bytes in pool memory hash to that value. A mismatch or a short
  segment is a miss, logged, counted in ``integrity_errors`` and dropped (a ``DROP`` record), so
  the next backup writes the page again.
* **Never outside the root.** The root is resolved once and held open; the log, the shard
  directories and the segments are one name each, opened relative to their directory's fd with
  ``O_NOFOLLOW`` (a symlink or a file standing in for a shard fails that batch, logged).
* **Shared.** Every store of a root reads the records others appended (one ``fstat`` of the log
  per call, and only its new tail), so a page stored by one process is found by all.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from hicache_core import BackendIOError

from ._agent import Agent, Hold
from ._format import digests
from ._index import BLOCK, CLEAR, DROP, PUT, Entry, Record, pack, parse

__all__ = ["Item", "PosixStore"]

log = logging.getLogger("hicache.nixl")
_GONE = -2  # _open_segment: no segment file by that name

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECT = getattr(os, "O_DIRECT", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_NOFOLLOW | O_CLOEXEC
LOG_NAME = "index.log"
ORPHAN_MAX_AGE_S = 3600.0
_ALIGN = 4096
_HOST = xxhash.xxh3_64_hexdigest(socket.gethostname().encode())[:8]
_SEGMENT = re.compile(r"([0-9a-f]{8})-([0-9]+)-[0-9a-f]{8}-[0-9]+")
# Runs adjacent in memory and in a file are merged into one NIXL descriptor up to this size:
# 32 MiB moved as 16 KiB I/Os took ~38 % longer than as 256 KiB I/Os, while buffered writes of
# 16 MiB per I/O into new files took 7-14x longer than 256 KiB ones (benchmarks/README.md)
_RUN_MAX = 256 << 10
# A read is moved in parts of at least this many bytes (at most _PARTS of them), each part's
# checksums computed on the hashing thread while the next part moves
_PART_MIN = 4 << 20
_PARTS = 8


@dataclass
class Item:
    """One component key and where its bytes are in registered DRAM."""

    key: str
    segments: Sequence[tuple[int, int]]
    length: int

    def aligned(self) -> bool:
        return all(a % _ALIGN == 0 and n % _ALIGN == 0 for a, n in self.segments)


def shard_of(name: str) -> str:
    return f"{xxhash.xxh3_64_intdigest(name.encode()) & 0xFF:02x}"


class PosixStore:
    """Segments and an index log under one root, moved by the agent's POSIX plugin."""

    def __init__(self, agent: Agent, root: str, o_direct: bool, fsync: bool) -> None:
        self.agent = agent
        self.fsync = fsync
        self.o_direct = o_direct and bool(O_DIRECT)
        os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self.root_fd = os.open(self.root, DIR_FLAGS)
        self._token = secrets.token_hex(4)
        self._shards: dict[str, int] = {}
        self._lock = threading.Lock()
        self._count = 0
        self.integrity_errors = 0
        # key -> (segment, offset, length, xxh3_64); segment -> live keys in it
        self._map: dict[str, tuple[str, int, int, int]] = {}
        self._live: dict[str, int] = {}
        self._pos = 0  # log bytes applied
        self._hasher: ThreadPoolExecutor | None = None
        self._hasher_pid = 0
        try:
            self.log_fd = os.open(
                LOG_NAME,
                os.O_RDWR | os.O_APPEND | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC,
                0o644,
                dir_fd=self.root_fd,
            )
            if not stat.S_ISREG(os.fstat(self.log_fd).st_mode):
                os.close(self.log_fd)
                raise OSError(errno.EINVAL, "not a regular file")
        except OSError as err:
            os.close(self.root_fd)
            raise BackendIOError(
                f"hicache nixl: {self.root}/{LOG_NAME} cannot be opened as the index log ({err.strerror}); "
                "remove whatever stands there (hicache-nixl never follows symlinks below its root)"
            ) from None
        self._make_shards()
        self._refresh()
        self._remove_orphans()

    def _make_shards(self) -> None:
        """Create the 256 shard directories once, at open, so no write pays for a ``mkdir``."""
        have = set(os.listdir(self.root_fd))
        made = LOG_NAME not in have
        for s in range(256):
            name = f"{s:02x}"
            if name not in have:
                try:
                    os.mkdir(name, 0o755, dir_fd=self.root_fd)
                    made = True
                except FileExistsError:
                    pass
        if made and self.fsync:
            os.fsync(self.root_fd)

    # ------------------------------------------------------------ directories
    def _shard(self, name: str, create: bool) -> int | None:
        """The fd of shard directory ``root/name`` (``None``: absent); ``BackendIOError`` when
        something else stands there (a symlink, a file) or it cannot be opened."""
        fd = self._shards.get(name)
        if fd is not None:
            try:
                if os.fstat(fd).st_nlink > 0:
                    return fd
            except OSError:
                pass
        try:
            try:
                new = os.open(name, DIR_FLAGS, dir_fd=self.root_fd)
            except FileNotFoundError:
                if not create:
                    return None
                try:
                    os.mkdir(name, 0o755, dir_fd=self.root_fd)  # mkdirat never follows a symlink
                except FileExistsError:
                    pass
                new = os.open(name, DIR_FLAGS, dir_fd=self.root_fd)
        except OSError as err:
            raise BackendIOError(
                f"hicache nixl: {self.root}/{name} cannot be opened as a directory ({err.strerror}); "
                "remove whatever stands there (hicache-nixl never follows symlinks below its root)"
            ) from None
        with self._lock:
            old = self._shards.get(name)
            if old is not None and old != fd:  # another thread opened it meanwhile
                os.close(new)
                return old
            self._shards[name] = new
        # a removed directory's old fd is left open: a batch may still use it
        return new

    def _remove_orphans(self) -> None:
        """Segments no record names whose writer died: this host's dead PIDs at once, others when old."""
        now = time.time()
        for s in range(256):
            try:
                fd = self._shard(f"{s:02x}", create=False)
            except BackendIOError:
                continue
            if fd is None:
                continue
            for name in os.listdir(fd):
                m = _SEGMENT.fullmatch(name)
                if m is None or name in self._live:
                    continue
                try:
                    if m.group(1) == _HOST and not _alive(int(m.group(2))):
                        os.unlink(name, dir_fd=fd)
                    elif now - os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime > ORPHAN_MAX_AGE_S:
                        os.unlink(name, dir_fd=fd)
                except OSError:
                    pass

    # ------------------------------------------------------------------- index
    def _refresh(self) -> None:
        """Apply the records appended to the log since the last call (by any store)."""
        with self._lock:
            self._catch_up()

    def _catch_up(self) -> None:
        """``_refresh`` with the lock held."""
        size = os.fstat(self.log_fd).st_size
        if size <= self._pos:
            return
        used, skipped, records = parse(os.pread(self.log_fd, size - self._pos, self._pos))
        if skipped:
            log.warning(
                "hicache nixl: %d damaged bytes of %s/%s skipped (their pages are misses)",
                skipped,
                self.root,
                LOG_NAME,
            )
        for rec in records:
            self._apply(rec)
        self._pos += used

    def _publish(self, rec: Record) -> None:
        """Append ``rec`` and apply it. When the log grew by exactly this record, the record is
        ours and is applied as built (not read back and parsed); else the log is read as usual."""
        data = pack(rec.kind, rec.name, rec.entries)
        with self._lock:
            self._catch_up()
            self._append(data)
            if os.fstat(self.log_fd).st_size == self._pos + len(data):
                self._apply(rec)
                self._pos += len(data)
                return
        self._refresh()

    def _apply(self, rec: Record) -> None:
        m, live = self._map, self._live
        if rec.kind == PUT:
            for e in rec.entries:
                old = m.get(e.key)
                if old is not None:
                    live[old[0]] -= 1
                m[e.key] = (rec.name, e.offset, e.length, e.digest)
                live[rec.name] = live.get(rec.name, 0) + 1
        elif rec.kind == DROP:
            for e in rec.entries:
                cur = m.get(e.key)
                if cur is not None and cur[0] == rec.name and cur[1] == e.offset:
                    del m[e.key]
                    live[rec.name] -= 1
        elif rec.kind == CLEAR:
            prefix = rec.name + "."
            for key in [k for k in m if k.startswith(prefix)]:
                live[m.pop(key)[0]] -= 1

    def _append(self, record: bytes) -> None:
        if os.write(self.log_fd, record) != len(record):
            raise OSError(errno.EIO, "short append to the index log")  # a torn record: skipped
        if self.fsync:
            os.fsync(self.log_fd)

    def _segment_name(self) -> str:
        with self._lock:
            self._count += 1
            n = self._count
        return f"{_HOST}-{os.getpid()}-{self._token}-{n}"  # the PID now: a forked child names its own

    # ------------------------------------------------------------------ exists
    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._refresh()
        m = self._map
        with self._lock:
            return [k in m for k in keys]

    # --------------------------------------------------------------------- set
    def put(self, items: Sequence[Item]) -> list[bool]:
        """Write the items not stored yet into one new segment, then publish them with one record
        (a stored key of the same length is kept and reported stored)."""
        self._refresh()
        out = [False] * len(items)
        with self._lock:
            known = [self._map.get(it.key) for it in items]
        todo = []
        for i, it in enumerate(items):
            k = known[i]
            if k is not None and k[2] == it.length:
                out[i] = True
            else:
                todo.append(i)
        if not todo:
            return out
        name = self._segment_name()
        try:
            shard = self._shard(shard_of(name), create=True)
        except BackendIOError as err:
            log.warning("%s", err)
            return out
        assert shard is not None  # create=True: opened or raised
        batch = [items[i] for i in todo]
        # objects placed in the order of their pool addresses: objects adjacent in memory are
        # adjacent in the segment too, and NIXL moves each such run as one I/O (see _xfer)
        offs, pos = [0] * len(batch), 0
        for j in sorted(range(len(batch)), key=lambda j: batch[j].segments[0][0] if batch[j].segments else 0):
            offs[j] = pos
            pos += -(-batch[j].length // BLOCK) * BLOCK
        fd = self._create(name, shard, self.o_direct and all(it.aligned() for it in batch))
        if fd < 0:
            return out
        published = False
        try:
            segs = [it.segments for it in batch]
            hasher = self._hashing(pos)
            pending = hasher.submit(digests, segs) if hasher is not None else None
            hold = Hold()
            ok = self._move("WRITE", batch, offs, [fd] * len(batch), hold)
            sums = pending.result() if pending is not None else digests(segs)
            if hold.abandoned:  # NIXL may still write to this fd: never close (and reuse) it
                hold.objects.append(fd)
                fd = -1
                return out
            good = [j for j in range(len(batch)) if ok[j]]
            if good:
                if self.fsync:
                    os.fsync(fd)
                    os.fsync(shard)
                size = os.fstat(fd).st_size
                good = [j for j in good if offs[j] + batch[j].length <= size]
            if good:
                entries = [Entry(batch[j].key, offs[j], batch[j].length, sums[j]) for j in good]
                self._publish(Record(PUT, name, entries))
                published = True
                for j in good:
                    out[todo[j]] = True
        except OSError as err:
            log.warning("hicache nixl: publishing a batch of %d objects failed: %s", len(batch), err)
        finally:
            if fd >= 0:
                os.close(fd)
                if not published:
                    try:
                        os.unlink(name, dir_fd=shard)
                    except OSError:
                        pass
        return out

    def _create(self, name: str, shard: int, direct: bool) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
        try:
            if direct:
                try:
                    return os.open(name, flags | O_DIRECT, 0o644, dir_fd=shard)
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    self.o_direct = False  # tmpfs & co
                    log.warning("hicache nixl: %s refuses O_DIRECT; using the page cache", self.root)
            return os.open(name, flags, 0o644, dir_fd=shard)
        except OSError as err:
            log.warning("hicache nixl: cannot create a segment in %s: %s", self.root, err)
            return -1

    # --------------------------------------------------------------------- get
    def get(self, items: Sequence[Item]) -> list[bool]:
        self._refresh()
        out = [False] * len(items)
        with self._lock:
            ents = [self._map.get(it.key) for it in items]
        groups: dict[str, list[int]] = {}
        for i, it in enumerate(items):
            e = ents[i]
            if e is not None and e[2] == it.length:
                groups.setdefault(e[0], []).append(i)
        fds: dict[str, int] = {}
        damaged: list[int] = []
        gone: list[int] = []
        live: list[int] = []
        try:
            for seg, idx in groups.items():
                fd = self._open_segment(seg, self.o_direct and all(items[i].aligned() for i in idx))
                if fd == _GONE:  # no segment file there (deleted, or a planted non-file): dropped
                    gone.extend(idx)
                if fd < 0:
                    continue
                fds[seg] = fd
                size = os.fstat(fd).st_size
                for i in idx:
                    e = ents[i]
                    assert e is not None
                    (live if e[1] + e[2] <= size else damaged).append(i)
            if live:
                hold = Hold()
                batch = [items[i] for i in live]
                where = [e for i in live if (e := ents[i]) is not None]
                hasher = self._hashing(sum(it.length for it in batch))
                parts = _parts(batch) if hasher is not None else [list(range(len(batch)))]
                sums: list[Future[list[int]] | list[int]] = []

                def landed(part: list[int], ok: list[bool]) -> None:
                    segs = [batch[j].segments if ok[j] else () for j in part]
                    sums.append(hasher.submit(digests, segs) if hasher is not None else digests(segs))

                offs = [e[1] for e in where]
                ok = self._move("READ", batch, offs, [fds[e[0]] for e in where], hold, parts, landed)
                if hold.abandoned:  # NIXL may still read these fds: never close (and reuse) them
                    hold.objects.extend(fds.values())
                    fds = {}
                    return out
                for part, got in zip(parts, sums):
                    for j, d in zip(part, got if isinstance(got, list) else got.result()):
                        if not ok[j]:
                            continue
                        if d == where[j][3]:
                            out[live[j]] = True
                        else:
                            damaged.append(live[j])
        finally:
            for fd in fds.values():
                os.close(fd)
        if damaged:
            self._drop([(items[i].key, ents[i]) for i in damaged], "failed its checksum")  # type: ignore[misc]
        if gone:
            self._drop([(items[i].key, ents[i]) for i in gone], "has no segment file")  # type: ignore[misc]
        return out

    def _open_segment(self, name: str, direct: bool) -> int:
        """A read fd of segment ``name``; :data:`_GONE` when there is no such regular file (its
        entries are dropped), ``-1`` when it cannot be opened now (a miss, nothing dropped)."""
        try:
            d = self._shard(shard_of(name), create=False)
        except BackendIOError as err:
            log.warning("%s", err)
            return -1
        if d is None:
            return _GONE
        flags = os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC
        try:
            fd = os.open(name, flags | (O_DIRECT if direct else 0), dir_fd=d)
        except FileNotFoundError:
            return _GONE  # cleared or deleted
        except OSError as err:
            if err.errno == errno.EINVAL and direct:
                self.o_direct = False
                return self._open_segment(name, False)
            if err.errno == errno.ELOOP:  # a symlink where a segment was: never followed
                return _GONE
            log.warning("hicache nixl: cannot open segment %s: %s", name, err)
            return -1
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return _GONE
        return fd

    def _drop(self, bad: Sequence[tuple[str, tuple[str, int, int, int]]], why: str) -> None:
        """Damaged or lost objects: counted, logged, and dropped from the index for every store
        (a ``DROP`` removes a key only while it still points at that segment)."""
        with self._lock:
            self.integrity_errors += len(bad)
        by_seg: dict[str, list[Entry]] = {}
        for key, (seg, off, n, d) in bad:
            log.warning("hicache nixl: %s %s (segment %s); treated as a miss and dropped", key, why, seg)
            by_seg.setdefault(seg, []).append(Entry(key, off, n, d))
        try:
            for seg, entries in by_seg.items():
                self._append(pack(DROP, seg, entries))
        except OSError as err:
            log.warning("hicache nixl: cannot record dropped objects: %s", err)
        self._refresh()

    # --------------------------------------------------------------- transfer
    def _move(
        self,
        op: str,
        items: Sequence[Item],
        offs: Sequence[int],
        fds: Sequence[int],
        hold: Hold,
        parts: Sequence[list[int]] | None = None,
        landed: Callable[[list[int], list[bool]], None] | None = None,
    ) -> list[bool]:
        """Move every item (``items[j]`` at ``offs[j]`` of ``fds[j]``): one NIXL transfer per part
        (default: one part), per item when a part fails; ``landed(part, ok)`` after each part."""
        ok = [False] * len(items)
        if not items:
            return ok
        ends: dict[int, int] = {}
        for it, off, fd in zip(items, offs, fds):
            ends[fd] = max(ends.get(fd, 0), off + it.length)
        agent = self.agent
        freg = agent.register([(0, max(end, 1), fd, "") for fd, end in ends.items()], "FILE")
        try:
            for part in parts if parts is not None else [list(range(len(items)))]:
                if self._xfer(op, items, offs, fds, part, hold):
                    for j in part:
                        ok[j] = True
                elif len(part) > 1 and not hold.abandoned:  # which ones failed: one transfer each
                    for j in part:
                        ok[j] = self._xfer(op, items, offs, fds, [j], hold)
                        if hold.abandoned:
                            break
                if hold.abandoned:
                    break
                if landed is not None:
                    landed(part, ok)
        finally:
            if not hold.abandoned:
                agent.deregister(freg)
        return ok

    def _hashing(self, nbytes: int) -> ThreadPoolExecutor | None:
        """The thread computing the checksums of a batch of ``nbytes`` beside NIXL's transfers;
        ``None`` (hash inline) for a batch under two read parts."""
        if nbytes < 2 * _PART_MIN:
            return None
        pid = os.getpid()
        if self._hasher is None or self._hasher_pid != pid:  # a forked child starts its own
            with self._lock:
                if self._hasher is None or self._hasher_pid != pid:
                    self._hasher = ThreadPoolExecutor(1, thread_name_prefix="hicache-nixl-hash")
                    self._hasher_pid = pid
        return self._hasher

    def _xfer(
        self,
        op: str,
        items: Sequence[Item],
        offs: Sequence[int],
        fds: Sequence[int],
        which: list[int],
        hold: Hold,
    ) -> bool:
        # one descriptor per run of bytes adjacent both in memory and in one file (up to
        # _RUN_MAX, never across a registered region's start): NIXL's POSIX plugin issues one
        # I/O per descriptor (benchmarks/README.md, "The nixl backend")
        runs: list[tuple[int, int, int, int]] = []
        for j in which:
            fd, off = fds[j], offs[j]
            for addr, n in items[j].segments:
                if n:
                    runs.append((addr, n, fd, off))
                    off += n
        runs.sort()
        bounds = self.agent.bounds  # a descriptor stays within one registered region
        local: list[tuple[int, int, int]] = []
        remote: list[tuple[int, int, int]] = []
        end = last_fd = end_off = -1
        for addr, n, fd, off in runs:
            if (
                addr == end
                and fd == last_fd
                and off == end_off
                and addr not in bounds
                and local[-1][1] + n <= _RUN_MAX
            ):
                a, m, _ = local[-1]
                local[-1] = (a, m + n, 0)
                remote[-1] = (remote[-1][0], m + n, fd)
            else:
                local.append((addr, n, 0))
                remote.append((off, n, fd))
            end, last_fd, end_off = addr + n, fd, off + n
        return self.agent.transfer(op, local, remote, "FILE", keep=hold)

    # ------------------------------------------------------------------- admin
    def clear(self, namespace: str) -> int:
        """Remove the namespace's keys (a ``CLEAR`` record) and the segments left with no live key."""
        self._refresh()
        prefix = namespace + "."
        with self._lock:
            removed = sum(1 for k in self._map if k.startswith(prefix))
        self._append(pack(CLEAR, namespace))
        self._refresh()
        with self._lock:
            dead = [s for s, n in self._live.items() if n <= 0]
            for s in dead:
                del self._live[s]
        for s in dead:
            try:
                d = self._shard(shard_of(s), create=False)
                if d is not None:
                    os.unlink(s, dir_fd=d)
            except (OSError, BackendIOError):
                pass
        return removed

    def close(self) -> None:
        with self._lock:
            fds = [*self._shards.values(), self.log_fd, self.root_fd]
            self._shards.clear()
            hasher, self._hasher = self._hasher, None
        if hasher is not None and self._hasher_pid == os.getpid():
            hasher.shutdown(wait=True)
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _parts(items: Sequence[Item]) -> list[list[int]]:
    """Indices of ``items`` in the order of their pool addresses, cut into up to :data:`_PARTS`
    parts of at least :data:`_PART_MIN` bytes (runs adjacent in memory stay merged within a part)."""
    order = sorted(range(len(items)), key=lambda j: items[j].segments[0][0] if items[j].segments else 0)
    total = sum(it.length for it in items)
    size = max(_PART_MIN, -(-total // _PARTS))
    parts: list[list[int]] = [[]]
    have = 0
    for j in order:
        if have >= size:
            parts.append([])
            have = 0
        parts[-1].append(j)
        have += items[j].length
    return parts


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
