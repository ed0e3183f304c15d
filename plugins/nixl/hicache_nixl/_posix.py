"""The POSIX side: one file per key under ``root``, moved by NIXL's POSIX plugin.

Layout: ``root/<shard>/<key>`` with 256 shard directories (two hex digits of the key's xxh3),
so no directory grows past what one ``clear`` can list; temp files live in ``root/~tmp`` (a
name no key can have). Nothing below ``root`` is reached through a symlink: the root is resolved
once and held open, every other name is one component opened relative to its directory's fd
with ``O_NOFOLLOW`` (``openat``, ``mkdirat``, ``renameat``, ``unlinkat``, ``fstatat``).

A page is published atomically: NIXL writes header and payload into a fresh temp file, which is
renamed over ``<shard>/<key>`` only after the transfer reported success (and, with ``fsync``,
after the file and both directories are synced). A reader opens the name once and reads that
inode, so it sees the old object or the whole new one. A read is checked (size, header, key,
payload checksum); a corrupt object is a miss, logged, counted and removed.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from hicache_core import BackendIOError

from ._agent import Agent, Hold
from ._format import HEADER, aligned_empty, digest, pack_header, verify_header

__all__ = ["Item", "PosixStore"]

log = logging.getLogger("hicache.nixl")

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECT = getattr(os, "O_DIRECT", 0)
O_TMPFILE = getattr(os, "O_TMPFILE", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_NOFOLLOW | O_CLOEXEC
TMP_DIR = "~tmp"  # keys start with [A-Za-z0-9]: never a key, never a shard
TEMP_MAX_AGE_S = 3600.0
_ALIGN = 4096
_HOST = xxhash.xxh3_64_hexdigest(socket.gethostname().encode())[:8]


@dataclass
class Item:
    """One component key and where its bytes are in registered DRAM."""

    key: str
    segments: Sequence[tuple[int, int]]
    length: int

    def aligned(self) -> bool:
        return all(a % _ALIGN == 0 and n % _ALIGN == 0 for a, n in self.segments)


def shard_of(key: str) -> str:
    return f"{xxhash.xxh3_64_intdigest(key.encode()) & 0xFF:02x}"


class PosixStore:
    """Files under one root, moved by the agent's POSIX plugin."""

    def __init__(self, agent: Agent, root: str, o_direct: bool, fsync: bool) -> None:
        self.agent = agent
        self.fsync = fsync
        self.o_direct = o_direct and bool(O_DIRECT)
        self.tmpfile = bool(O_TMPFILE) and os.path.isdir("/proc/self/fd")
        os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self.root_fd = os.open(self.root, DIR_FLAGS)
        self._shards: dict[str, int] = {}
        self._lock = threading.Lock()
        self._count = 0
        self.integrity_errors = 0
        tmp_fd = self._subdir(TMP_DIR, create=True)
        assert tmp_fd is not None  # create=True: opened or raised
        self.tmp_fd: int = tmp_fd
        self._remove_orphans()
        self._make_shards()

    def _make_shards(self) -> None:
        """Create the 256 shard directories once, at open, so no write pays for a ``mkdir``."""
        have = set(os.listdir(self.root_fd))
        made = False
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
    def _subdir(self, name: str, create: bool) -> int | None:
        """The fd of directory ``root/name`` (``None``: absent and not created); ``BackendIOError``
        when something else stands there (a symlink, a file) or it cannot be opened."""
        try:
            try:
                return os.open(name, DIR_FLAGS, dir_fd=self.root_fd)
            except FileNotFoundError:
                if not create:
                    return None
            try:
                os.mkdir(name, 0o755, dir_fd=self.root_fd)  # mkdirat never follows a symlink
                if self.fsync:
                    os.fsync(self.root_fd)
            except FileExistsError:
                pass
            return os.open(name, DIR_FLAGS, dir_fd=self.root_fd)
        except OSError as err:
            raise BackendIOError(
                f"hicache nixl: {self.root}/{name} cannot be opened as a directory ({err.strerror}); "
                "remove whatever stands there (hicache-nixl never follows symlinks below its root)"
            ) from None

    def _shard_or_none(self, key: str, create: bool) -> int | None:
        """:meth:`_shard` of ``key``'s shard, ``None`` (logged) when it cannot be used: that page fails."""
        try:
            return self._shard(shard_of(key), create)
        except BackendIOError as err:
            log.warning("%s", err)
            return None

    def _shard(self, name: str, create: bool) -> int | None:
        fd = self._shards.get(name)
        if fd is not None:
            try:
                if os.fstat(fd).st_nlink > 0:
                    return fd
            except OSError:
                pass
        new = self._subdir(name, create)
        if new is None:
            return None
        with self._lock:
            old = self._shards.get(name)
            if old is not None and old != fd:  # another thread opened it meanwhile
                os.close(new)
                return old
            self._shards[name] = new
        # a removed directory's old fd is left open: a batch may still use it
        return new

    def _remove_orphans(self) -> None:
        """Temp files of writers that died: this host's dead PIDs at once, others when old."""
        now = time.time()
        for name in os.listdir(self.tmp_fd):
            host, _, rest = name.partition("-")
            pid = rest.partition("-")[0]
            try:
                if host == _HOST and pid.isdigit() and not _alive(int(pid)):
                    os.unlink(name, dir_fd=self.tmp_fd)
                elif now - os.stat(name, dir_fd=self.tmp_fd, follow_symlinks=False).st_mtime > TEMP_MAX_AGE_S:
                    os.unlink(name, dir_fd=self.tmp_fd)
            except OSError:
                pass

    def _temp_name(self) -> str:
        with self._lock:
            self._count += 1
            n = self._count
        return f"{_HOST}-{os.getpid()}-{threading.get_ident() & 0xFFFFFF:x}-{n}"

    # ------------------------------------------------------------------ exists
    def exists(self, keys: Sequence[str]) -> list[bool]:
        out = []
        for key in keys:
            fd = self._shard_or_none(key, create=False)
            if fd is None:
                out.append(False)
                continue
            try:
                st = os.stat(key, dir_fd=fd, follow_symlinks=False)
                out.append(stat.S_ISREG(st.st_mode) and st.st_size >= HEADER)
            except OSError:
                out.append(False)
        return out

    # --------------------------------------------------------------------- set
    def put(self, items: Sequence[Item]) -> list[bool]:
        """Publish each item (an existing key is kept and reported stored)."""
        out = [False] * len(items)
        todo: list[int] = []
        dirs: list[int] = []
        for i, it in enumerate(items):
            d = self._shard_or_none(it.key, create=True)
            if d is None:
                continue
            try:
                st = os.stat(it.key, dir_fd=d, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_size == HEADER + it.length:
                    out[i] = True  # same key, same bytes: keep the stored object
                    continue  # (one of another size, e.g. truncated, is replaced)
            except FileNotFoundError:
                pass
            except OSError as err:
                log.warning("hicache nixl: cannot stat %s: %s", it.key, err)
                continue
            todo.append(i)
            dirs.append(d)
        if not todo:
            return out
        heads = aligned_empty(HEADER * len(todo))
        temps: list[tuple[int, str] | None] = []
        try:
            for j, i in enumerate(todo):
                it = items[i]
                pack_header(heads[j * HEADER : (j + 1) * HEADER], it.key, it.length, digest(it.segments))
                temps.append(self._create_temp(it, dirs[j]))
            hold = Hold(heads)
            ok = self._move(
                "WRITE", [items[i] for i in todo], heads, [t[0] if t else -1 for t in temps], hold
            )
            if hold.abandoned:  # NIXL may still write to these fds: never close (and reuse) them
                hold.objects.extend(temps)
                temps = []
                return out
            for j, i in enumerate(todo):
                t = temps[j]
                if t is None or not ok[j]:
                    continue
                fd, name = t
                try:
                    if self.fsync:
                        os.fsync(fd)
                    if os.fstat(fd).st_size != HEADER + items[i].length:
                        raise OSError(errno.EIO, "short write")
                    if name:
                        os.rename(name, items[i].key, src_dir_fd=self.tmp_fd, dst_dir_fd=dirs[j])
                        temps[j] = (fd, "")
                    else:
                        self._link(fd, items[i], dirs[j])
                    if self.fsync:
                        os.fsync(dirs[j])
                    out[i] = True
                except OSError as err:
                    log.warning("hicache nixl: publishing %s failed: %s", items[i].key, err)
        finally:
            for t in temps:
                if t is None:
                    continue
                fd, name = t
                os.close(fd)
                if name:
                    try:
                        os.unlink(name, dir_fd=self.tmp_fd)
                    except OSError:
                        pass
        return out

    def _create_temp(self, it: Item, shard_fd: int) -> tuple[int, str] | None:
        """A file to write ``it`` into: ``(fd, "")`` for an unnamed ``O_TMPFILE`` inode in the shard
        (nothing is left behind by a killed writer; published with ``linkat``), else ``(fd, name)``
        of a named temp file in ``~tmp`` (renamed into place)."""
        direct = O_DIRECT if self.o_direct and it.aligned() else 0
        if self.tmpfile:
            try:
                return os.open(".", os.O_RDWR | O_TMPFILE | O_CLOEXEC | direct, 0o644, dir_fd=shard_fd), ""
            except OSError as err:
                if direct and err.errno == errno.EINVAL:  # tmpfs & co: no O_DIRECT
                    self.o_direct = False
                    log.warning("hicache nixl: %s refuses O_DIRECT; using the page cache", self.root)
                    return self._create_temp(it, shard_fd)
                self.tmpfile = False
                log.info("hicache nixl: %s has no O_TMPFILE (%s); using named temp files", self.root, err)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
        name = self._temp_name()
        try:
            if self.o_direct and it.aligned():
                try:
                    return os.open(name, flags | O_DIRECT, 0o644, dir_fd=self.tmp_fd), name
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    self.o_direct = False
                    log.warning("hicache nixl: %s refuses O_DIRECT; using the page cache", self.root)
            return os.open(name, flags, 0o644, dir_fd=self.tmp_fd), name
        except OSError as err:
            log.warning("hicache nixl: cannot create a temp file in %s/%s: %s", self.root, TMP_DIR, err)
            return None

    def _link(self, fd: int, it: Item, shard_fd: int) -> None:
        """Give the unnamed inode ``fd`` the name ``it.key`` (a stale object of another size is
        replaced; one of this size published meanwhile by another writer is kept)."""
        src = f"/proc/self/fd/{fd}"
        try:
            os.link(src, it.key, dst_dir_fd=shard_fd, follow_symlinks=True)
        except FileExistsError:
            st = os.stat(it.key, dir_fd=shard_fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_size == HEADER + it.length:
                return
            os.unlink(it.key, dir_fd=shard_fd)
            os.link(src, it.key, dst_dir_fd=shard_fd, follow_symlinks=True)

    # --------------------------------------------------------------------- get
    def get(self, items: Sequence[Item]) -> list[bool]:
        out = [False] * len(items)
        fds: list[int] = [-1] * len(items)
        try:
            for i, it in enumerate(items):
                fds[i] = self._open_read(it)
            live = [i for i in range(len(items)) if fds[i] >= 0]
            if not live:
                return out
            heads = aligned_empty(HEADER * len(live))
            hold = Hold(heads)
            ok = self._move("READ", [items[i] for i in live], heads, [fds[i] for i in live], hold)
            if hold.abandoned:  # NIXL may still read these fds: never close (and reuse) them
                hold.objects.extend(fds)
                fds = []
                return out
            for j, i in enumerate(live):
                if not ok[j]:
                    continue
                it = items[i]
                want = verify_header(heads[j * HEADER : (j + 1) * HEADER], it.key, it.length)
                if want is not None and want == digest(it.segments):
                    out[i] = True
                else:
                    self._corrupt(it.key, fds[i])
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        return out

    def _open_read(self, it: Item) -> int:
        d = self._shard_or_none(it.key, create=False)
        if d is None:
            return -1
        flags = os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC
        if self.o_direct and it.aligned():
            flags |= O_DIRECT
        try:
            fd = os.open(it.key, flags, dir_fd=d)
        except FileNotFoundError:
            return -1
        except OSError as err:
            if err.errno == errno.EINVAL and flags & O_DIRECT:
                self.o_direct = False
                return self._open_read(it)
            log.warning("hicache nixl: cannot open %s: %s", it.key, err)
            return -1
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != HEADER + it.length:
            os.close(fd)  # another size is a miss, not corruption
            return -1
        return fd

    def _corrupt(self, key: str, fd: int) -> None:
        """Remove a corrupt object if the name still points at it (a newer one is kept)."""
        with self._lock:
            self.integrity_errors += 1
        log.warning("hicache nixl: %s failed its checksum; treated as a miss and removed", key)
        d = self._shard_or_none(key, create=False)
        if d is None:
            return
        try:
            mine, now = os.fstat(fd), os.stat(key, dir_fd=d, follow_symlinks=False)
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(key, dir_fd=d)
        except OSError:
            pass

    # --------------------------------------------------------------- transfer
    def _move(
        self, op: str, items: Sequence[Item], heads: np.ndarray, fds: Sequence[int], hold: Hold
    ) -> list[bool]:
        """One NIXL transfer for every item with an fd (header + payload each); per item on failure."""
        live = [j for j, fd in enumerate(fds) if fd >= 0]
        ok = [False] * len(items)
        if not live:
            return ok
        agent = self.agent
        base = heads.ctypes.data
        hreg = agent.register([(base, heads.nbytes, 0, "")], "DRAM")
        try:
            freg = agent.register([(0, HEADER + items[j].length, fds[j], "") for j in live], "FILE")
            try:
                if self._xfer(op, items, base, fds, live, hold):
                    for j in live:
                        ok[j] = True
                elif len(live) > 1 and not hold.abandoned:  # which ones failed: one transfer each
                    for j in live:
                        ok[j] = self._xfer(op, items, base, fds, [j], hold)
                        if hold.abandoned:
                            break
            finally:
                if not hold.abandoned:
                    agent.deregister(freg)
        finally:
            if not hold.abandoned:
                agent.deregister(hreg)
        return ok

    def _xfer(
        self, op: str, items: Sequence[Item], base: int, fds: Sequence[int], which: list[int], hold: Hold
    ) -> bool:
        local: list[tuple[int, int, int]] = []
        remote: list[tuple[int, int, int]] = []
        for j in which:
            fd = fds[j]
            local.append((base + j * HEADER, HEADER, 0))
            remote.append((0, HEADER, fd))
            off = HEADER
            for addr, n in items[j].segments:
                if n:
                    local.append((addr, n, 0))
                    remote.append((off, n, fd))
                    off += n
        return self.agent.transfer(op, local, remote, "FILE", keep=hold)

    # ------------------------------------------------------------------- admin
    def clear(self, namespace: str) -> int:
        prefix = namespace + "."
        removed = 0
        for s in range(256):
            try:
                fd = self._shard(f"{s:02x}", create=False)
            except BackendIOError as err:
                log.warning("hicache nixl: clear skips a shard: %s", err)
                continue
            if fd is None:
                continue
            for name in os.listdir(fd):
                if name.startswith(prefix):
                    try:
                        os.unlink(name, dir_fd=fd)
                        removed += 1
                    except FileNotFoundError:
                        pass
        return removed

    def close(self) -> None:
        with self._lock:
            fds = [*self._shards.values(), self.tmp_fd, self.root_fd]
            self._shards.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
