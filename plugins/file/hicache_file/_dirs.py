"""Directory file descriptors: nothing below the root is ever reached through a symlink.

The root is resolved once, when the store is opened (an operator may configure it through a
symlink), and held open as a directory fd. Every other name is one path component opened
relative to the fd of its parent: namespace and shard directories with
``O_DIRECTORY | O_NOFOLLOW`` (a symlink or a file in their place fails with ``ENOTDIR`` or
``ELOOP``), created with ``mkdirat`` (which never follows either), and page files with
``O_NOFOLLOW``, ``faccessat(AT_SYMLINK_NOFOLLOW)``, ``linkat``/``renameat``/``unlinkat``
relative to their shard's fd. No path with a ``/`` below the root is ever handed to the kernel.

Shard and namespace fds are cached (one per directory; past ``MAX_OPEN`` they are all closed
and opened again on use): a page costs the same syscalls as with absolute paths, with a
one-component lookup, and a batch whose directories are all open adds none. A directory
removed by a ``clear`` (here or in another process) is noticed when it matters: the backend
calls :meth:`DirTree.refresh` after a write fails or a key is missed in it, which checks the
fd with ``fstat`` (a removed directory has no links left) and opens it again by name. A
replaced fd is closed only once no batch is running (:meth:`DirTree.enter` /
:meth:`DirTree.leave`), so an fd number is never reused under a thread still using it.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterable

from ._format import TEMP_DIR

__all__ = ["ABSENT", "MAX_OPEN", "Dir", "DirTree", "describe", "open_dir"]

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_NOFOLLOW | O_CLOEXEC
ABSENT = -1  # the directory did not exist when last looked at
UNKNOWN = -2  # not opened (yet, or any more)
MAX_OPEN = 256  # cached directory fds per store (a namespace uses 17)


def open_dir(name: str, parent_fd: int | None = None) -> int:
    """Open directory ``name`` (relative to ``parent_fd``) without following a symlink."""
    if parent_fd is None:
        return os.open(name, DIR_FLAGS)
    return os.open(name, DIR_FLAGS, dir_fd=parent_fd)


def describe(err: OSError, path: str, name: str | None = None, parent_fd: int | None = None) -> OSError:
    """``err`` for ``path``, saying plainly when a symlink or a file stands in for a directory.

    (``open(O_DIRECTORY | O_NOFOLLOW)`` of a symlink fails with ``ENOTDIR``: ``name`` in
    ``parent_fd`` is looked at to tell.)
    """
    link = err.errno == errno.ELOOP
    if not link and err.errno == errno.ENOTDIR and name is not None:
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
        except OSError:
            pass
    if link:
        why = "is a symlink; hicache-file never follows symlinks below its root (remove it)"
    elif err.errno == errno.ENOTDIR:
        why = "is not a directory (remove it)"
    else:
        why = err.strerror or str(err)
    return OSError(err.errno, why, path)


class Dir:
    """One directory: the root (no parent) or a namespace or shard directory below it."""

    __slots__ = ("fd", "name", "parent", "path")

    def __init__(self, parent: Dir | None, name: str, path: str) -> None:
        self.parent = parent
        self.name = name
        self.path = path  # for messages only
        self.fd = UNKNOWN

    def __repr__(self) -> str:
        return f"Dir({self.path!r}, fd={self.fd})"


class DirTree:
    """The root's fd and a cache of fds of the directories below it (see the module docstring)."""

    def __init__(self, root: str, fsync: bool = False) -> None:
        self.root = root
        self.fsync = fsync
        self.top = Dir(None, root, root)
        self.top.fd = open_dir(root)
        self._dirs: dict[tuple[str, str], Dir] = {}
        self._held: set[Dir] = {self.top}
        self._retired: list[int] = []
        self._users = 0
        self._lock = threading.Lock()
        self.tmp = Dir(self.top, TEMP_DIR, f"{root}/{TEMP_DIR}")  # rename mode's temp files

    # -------------------------------------------------------------- registry
    def dir(self, ns: str, shard: str = "") -> Dir:
        """The :class:`Dir` of namespace ``ns`` (``shard=""``) or of shard ``ns/shard``."""
        d = self._dirs.get((ns, shard))
        if d is None:
            if len(self._dirs) > 16 * MAX_OPEN:  # bounded: hostile keys may name many namespaces
                self._dirs.clear()
            if shard:
                parent = self.dir(ns)
                d = Dir(parent, shard, f"{parent.path}/{shard}")
            else:
                d = Dir(self.top, ns, f"{self.root}/{ns}")
            d = self._dirs.setdefault((ns, shard), d)
        return d

    # --------------------------------------------------------------- users
    def enter(self) -> None:
        """A batch starts: no fd retired from now on is closed before :meth:`leave`."""
        with self._lock:
            self._users += 1

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            fds: list[int] = []
            if not self._users and self._retired:
                fds, self._retired = self._retired, []
        for fd in fds:
            os.close(fd)

    # --------------------------------------------------------------- opening
    def prepare(self, dirs: Iterable[Dir], create: bool) -> tuple[dict[Dir, int], dict[Dir, OSError]]:
        """The fd to use for each directory in ``dirs`` during this batch (call inside
        :meth:`enter` / :meth:`leave`).

        ``create``: make missing directories. A directory that is missing (and not created) maps
        to ``ABSENT``; one that cannot be opened (a symlink, a file, no permission) maps to
        ``ABSENT`` too and its error is in the second dict.
        """
        if len(self._held) > MAX_OPEN:
            self.release()
        seen: dict[Dir, int | OSError] = {}
        fds: dict[Dir, int] = {}
        errs: dict[Dir, OSError] = {}
        for d in dirs:
            r = self._ready(d, create, seen)
            if type(r) is int:
                fds[d] = r
            else:
                fds[d] = ABSENT
                errs[d] = r  # type: ignore[assignment]
        return fds, errs

    def refresh(self, d: Dir, create: bool) -> int:
        """``d``'s fd, opened again if it was removed meanwhile; raises ``OSError``."""
        r = self._ready(d, create, {})
        if type(r) is not int:
            raise r  # type: ignore[misc]
        return r

    def _ready(self, d: Dir, create: bool, seen: dict[Dir, int | OSError]) -> int | OSError:
        r = seen.get(d)
        if r is not None:
            return r
        fd = d.fd
        if fd >= 0 and _alive(fd):
            r = fd
        elif d.parent is None:  # the root: by the path resolved at open (after a close)
            try:
                r = self._swap(d, open_dir(d.name))
            except OSError as err:
                r = describe(err, d.path)
        else:
            p = self._ready(d.parent, create, seen)
            if type(p) is not int:
                r = p
            elif p < 0:
                r = self._swap(d, ABSENT)
            else:
                r = self._open(d, p, create)
        seen[d] = r
        return r

    def _open(self, d: Dir, parent_fd: int, create: bool) -> int | OSError:
        try:
            try:
                return self._swap(d, open_dir(d.name, parent_fd))
            except FileNotFoundError:
                if not create:
                    return self._swap(d, ABSENT)
            try:
                os.mkdir(d.name, 0o755, dir_fd=parent_fd)  # mkdirat: never follows a symlink
            except FileExistsError:
                pass  # made by a racing writer (or a dangling symlink: the open below says so)
            else:
                if self.fsync:  # the new entry must survive a power loss too
                    os.fsync(parent_fd)
            return self._swap(d, open_dir(d.name, parent_fd))
        except OSError as err:
            self._swap(d, UNKNOWN)
            return describe(err, d.path, d.name, parent_fd)

    def _swap(self, d: Dir, fd: int) -> int:
        with self._lock:
            old, d.fd = d.fd, fd
            if fd >= 0:
                self._held.add(d)
            else:
                self._held.discard(d)
            if old >= 0 and old != fd:
                self._retire(old)
        return fd

    def _retire(self, fd: int) -> None:  # with self._lock held
        if self._users:
            self._retired.append(fd)
        else:
            os.close(fd)

    def forget(self, ns: str) -> None:
        """Drop the cached fds of namespace ``ns`` and its shards (after clearing it)."""
        top = self.top
        with self._lock:
            for d in list(self._held):
                p = d.parent
                if (p is top and d.name == ns) or (p is not None and p.parent is top and p.name == ns):
                    self._held.discard(d)
                    self._retire(d.fd)
                    d.fd = UNKNOWN

    def release(self, root: bool = False) -> None:
        """Close every cached fd (``root``: the root's too); they are opened again on use."""
        with self._lock:
            for d in list(self._held):
                if d is self.top and not root:
                    continue
                self._held.discard(d)
                self._retire(d.fd)
                d.fd = UNKNOWN

    def close(self) -> None:
        """Close everything now (the store is gone: no batch can be running)."""
        with self._lock:
            fds = [d.fd for d in self._held] + self._retired
            for d in self._held:
                d.fd = UNKNOWN
            self._held.clear()
            self._retired = []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _alive(fd: int) -> bool:
    """The directory behind ``fd`` still has a name (``rmdir`` leaves it with no links)."""
    try:
        return os.fstat(fd).st_nlink > 0
    except OSError:  # ESTALE on NFS, ...
        return False
