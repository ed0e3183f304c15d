"""Atomic publication of one page file, the root checks done at open, and temp-file sweeping.

Two ways to make a complete file appear under its final name in one step, both relative to the
shard directory's fd (see :mod:`hicache_file._dirs`: nothing below the root is followed):

* ``O_TMPFILE`` (Linux; ext4, xfs, btrfs, tmpfs): write an unnamed inode in the shard
  directory, then ``linkat`` it to its name through ``/proc/self/fd``. The name appears
  atomically with the whole content; a writer killed before the link leaves nothing behind
  (the kernel frees the inode); ``EEXIST`` means another writer published the key first, and
  its page is kept. One directory insertion per page, like a plain ``open(O_CREAT)``.
* temp file + ``rename`` (portable fallback, chosen when the probe at open fails, e.g. NFS):
  ``.tmp-<host>-<pid>-<token>-<n>`` in the root's ``.hicache-tmp`` directory, ``renameat``
  over the final name. A killed writer may leave a temp file (never read as a page); every
  open removes those whose writer is dead (same host and PID namespace, PID gone) or that are
  older than ``temp_max_age_s``: one ``scandir`` of that one directory, whatever the number of
  pages.

Either way the final name only ever points at a complete page.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import secrets
import stat
import time
from typing import Any

from . import _format as fmt
from ._dirs import O_CLOEXEC, O_NOFOLLOW, DirTree, describe
from ._errors import FileRootError

__all__ = ["HOST", "Publisher", "open_root", "sweep_dir", "sweep_temps", "temp_name"]

_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
_ANON = os.O_WRONLY | _O_TMPFILE | O_CLOEXEC


def _host() -> str:
    """8 hex digits naming this boot of this host and this PID namespace (``""``: unknown).

    A temp file whose name carries our tag and a PID that does not run is an orphan for sure.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return hashlib.sha256(f"{boot}/{pidns}".encode()).hexdigest()[:8]


HOST = _host()
_TOKEN = secrets.token_hex(4)
_SEQ = itertools.count()


def temp_name(prefix: str = fmt.TEMP_PREFIX) -> str:
    """``<prefix><host>-<pid>-<token>-<n>``: unique, and tells :func:`sweep_temps` its writer."""
    return f"{prefix}{HOST or 'x'}-{os.getpid()}-{_TOKEN}-{next(_SEQ)}"


class Publisher:
    """Writes ``header + payload`` and publishes it under its final name, atomically."""

    def __init__(self, anonymous: bool, fsync: bool) -> None:
        self.anonymous = anonymous
        self.fsync = fsync

    def publish(self, dfd: int, key: str, bufs: list[Any], total: int, tmp_dfd: int) -> bool:
        """Write ``bufs`` (``total`` bytes) and publish them as ``key`` in directory ``dfd``.

        ``tmp_dfd``: the temp directory (``rename`` mode only). Returns ``False`` when another
        writer published ``key`` first (its page is kept; the caller reports the key as
        present). Raises ``OSError`` on failure (``ENOENT`` or ``EPERM`` in a directory removed
        meanwhile: the caller checks it, opens it again and retries), after removing any temp
        file: the final name never holds a partial page.
        """
        if self.anonymous:
            fd = os.open(".", _ANON, 0o644, dir_fd=dfd)
            try:
                self._write(fd, bufs, total)
                try:  # the source is absolute: linkat(AT_SYMLINK_FOLLOW) of the open inode
                    os.link(f"/proc/self/fd/{fd}", key, src_dir_fd=dfd, dst_dir_fd=dfd)
                except FileExistsError:
                    return False
            finally:
                os.close(fd)
            return True
        tmp = temp_name()
        fd = os.open(tmp, _CREATE, 0o644, dir_fd=tmp_dfd)
        try:
            try:
                self._write(fd, bufs, total)
            finally:
                os.close(fd)
            os.rename(tmp, key, src_dir_fd=tmp_dfd, dst_dir_fd=dfd)  # replaces a symlink, never follows
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=tmp_dfd)
            raise
        return True

    def _write(self, fd: int, bufs: list[Any], total: int) -> None:
        n = os.writev(fd, bufs)
        if n != total:
            _write_rest(fd, bufs, n, total)
        if self.fsync:
            os.fsync(fd)


def _write_rest(fd: int, bufs: list[Any], done: int, total: int) -> None:
    """Finish a short ``writev``: write what is left, raising on no progress."""
    for b in bufs:
        v = memoryview(b).cast("B")
        if done >= len(v):
            done -= len(v)
            continue
        rest, done = v[done:], 0
        while len(rest):
            n = os.write(fd, rest)
            if n <= 0:
                raise OSError(errno.EIO, f"short write ({total} bytes expected)")
            rest = rest[n:]


def open_root(
    root: str, fsync: bool, mode: str = "auto", temp_max_age_s: float = 3600.0, layout: str = fmt.LAYOUT
) -> tuple[DirTree, Publisher, int]:
    """Create ``root`` if needed, check it is a writable directory, stamp/check the format.

    ``root`` may be (or pass through) a symlink: it is resolved here, once, and held open as
    a directory fd; nothing below it is ever followed. Returns the :class:`DirTree`, the
    :class:`Publisher` and the number of orphan temp files removed (:func:`sweep_temps`).
    ``mode`` ``"auto"``: ``O_TMPFILE`` when a probe file can be created and linked that way,
    else temp file + rename; ``"tmpfile"``: require it; ``"rename"``: never use it. ``layout``:
    what the root's marker must record (a root of another layout is refused). Raises
    :class:`FileRootError`.
    """
    fix = (
        "set options.root to a writable directory (for example "
        '`HICACHE_OPTIONS=\'{"root": "/path/to/cache"}\'`) or fix its permissions'
    )
    try:
        _make_root(root, fsync)
    except OSError as err:
        raise FileRootError(
            f"file backend root {root!r} cannot be created: [Errno {err.errno}] "
            f"{err.strerror or err} ({err.filename or root}); {fix}"
        ) from None
    real = os.path.realpath(root)
    try:
        tree = DirTree(real, fsync)
    except NotADirectoryError:
        raise FileRootError(f"file backend root {root!r} exists but is not a directory; {fix}") from None
    except OSError as err:
        raise FileRootError(
            f"file backend root {root!r} cannot be opened: [Errno {err.errno}] {err.strerror or err}; {fix}"
        ) from None
    try:
        publisher, removed = _setup(tree, root, fsync, mode, temp_max_age_s, fix, layout)
    except BaseException:
        tree.close()
        raise
    return tree, publisher, removed


def _make_root(root: str, fsync: bool) -> None:
    """``os.makedirs(root)``; with ``fsync``, then ``fsync`` the parent of every directory it
    had to create (else a power loss could take the new root, and the durable pages in it, away)."""
    path = os.path.abspath(root)
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    os.makedirs(root, exist_ok=True)
    if fsync:
        for made in reversed(missing):
            fd = os.open(os.path.dirname(made), os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _setup(
    tree: DirTree, root: str, fsync: bool, mode: str, temp_max_age_s: float, fix: str, layout: str
) -> tuple[Publisher, int]:
    rfd = tree.top.fd
    probe = temp_name()
    try:
        os.close(os.open(probe, _CREATE, 0o644, dir_fd=rfd))
        os.unlink(probe, dir_fd=rfd)
    except OSError as err:
        raise FileRootError(
            f"file backend root {root!r} is not writable: [Errno {err.errno}] {err.strerror or err}; {fix}"
        ) from None
    _check_marker(tree, root, fsync, layout)
    anonymous = mode != "rename" and _anonymous_works(rfd)
    if mode == "tmpfile" and not anonymous:
        raise FileRootError(
            f"file backend root {root!r} does not support O_TMPFILE + linkat through /proc "
            '(needs Linux, /proc and ext4/xfs/btrfs/tmpfs); set options.publish to "auto" or "rename"'
        )
    if not anonymous:
        try:
            tree.refresh(tree.tmp, True)
        except OSError as err:
            raise FileRootError(
                f"file backend root {root!r}: cannot use {err.filename}: {err.strerror}"
            ) from None
    return Publisher(anonymous, fsync), sweep_temps(tree, temp_max_age_s)


def _anonymous_works(rfd: int) -> bool:
    if not _O_TMPFILE:
        return False
    try:
        fd = os.open(".", _ANON, 0o644, dir_fd=rfd)
    except OSError:
        return False  # EOPNOTSUPP / EISDIR / EINVAL: the filesystem has no O_TMPFILE
    probe = temp_name()
    try:
        os.write(fd, b"x")
        os.link(f"/proc/self/fd/{fd}", probe, src_dir_fd=rfd, dst_dir_fd=rfd)
        os.unlink(probe, dir_fd=rfd)
        return True
    except OSError:
        return False  # no /proc, or linkat refused
    finally:
        os.close(fd)


def sweep_temps(tree: DirTree, max_age_s: float) -> int:
    """Remove orphan temp files; return how many.

    Looked at: the ``.hicache-tmp`` directory (``rename`` mode's temp files) and the root
    itself (format-marker temps and probes of an interrupted open). A temp file is an orphan
    when its name says it was made on this host and PID namespace by a process that no longer
    runs, or when it is older than ``max_age_s`` (a writer on another host, or a name from an
    older hicache-file). Temp files that older versions left in shard directories are swept by
    the ``max_bytes`` scan and by clearing their namespace. Only entries of these two
    directories are unlinked (``unlinkat`` never follows a symlink).
    """
    cutoff = time.time_ns() - int(max_age_s * 1e9)
    removed = 0
    rfd = tree.top.fd
    removed += sweep_dir(rfd, (fmt.TEMP_PREFIX, fmt.MARKER_NAME + "."), cutoff)
    try:
        tfd = tree.refresh(tree.tmp, False)
    except OSError:
        return removed  # a symlink or a file in its place: never followed (writes will say so)
    if tfd >= 0:
        removed += sweep_dir(tfd, (fmt.TEMP_PREFIX,), cutoff)
    return removed


def sweep_dir(dfd: int, prefixes: tuple[str, ...], cutoff_ns: int) -> int:
    """Unlink the files of ``dfd`` named ``<prefix><host>-<pid>-...`` whose writer is gone
    from this host, or (any name with a prefix) last modified before ``cutoff_ns``."""
    removed = 0
    try:
        with os.scandir(dfd) as it:
            entries = [e for e in it if e.name.startswith(prefixes)]
    except OSError:
        return 0
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        rest = e.name[len(next(p for p in prefixes if e.name.startswith(p))) :]
        if st.st_mtime_ns >= cutoff_ns and not _writer_gone(rest):
            continue
        try:
            os.unlink(e.name, dir_fd=dfd)
            removed += 1
        except OSError:
            pass
    return removed


def _writer_gone(rest: str) -> bool:
    """``rest`` is ``<host>-<pid>-...``: made here by a process that no longer runs."""
    host, _, tail = rest.partition("-")
    pid = tail.partition("-")[0]
    if not HOST or host != HOST or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it runs (as another user)
        return False
    return False


def _check_marker(tree: DirTree, root: str, fsync: bool, layout: str) -> None:
    rfd = tree.top.fd
    try:
        fd = os.open(fmt.MARKER_NAME, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC, dir_fd=rfd)
    except FileNotFoundError:
        info = None
    except OSError as err:
        err = describe(err, f"{tree.root}/{fmt.MARKER_NAME}")
        raise FileRootError(
            f"file backend root {root!r}: cannot read {fmt.MARKER_NAME}: {err}; delete that file "
            "or use another root"
        ) from None
    else:
        try:
            with open(fd, encoding="utf-8", closefd=True) as f:
                info = json.load(f)
        except (OSError, ValueError) as err:
            raise FileRootError(
                f"file backend root {root!r}: cannot read {fmt.MARKER_NAME}: {err}; delete that file "
                "or use another root"
            ) from None
    if info is None:
        # A root without the marker must be empty (or hold only our temp files): never adopt a
        # directory with other content, whose files LRU eviction or clear could then touch.
        with os.scandir(rfd) as it:
            foreign = sorted(
                e.name for e in it if not e.name.startswith((fmt.TEMP_PREFIX, fmt.MARKER_NAME, fmt.TEMP_DIR))
            )
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise FileRootError(
                f"file backend root {root!r} is not empty ({shown}) and has no {fmt.MARKER_NAME}, "
                "so it was not created by hicache-file; set options.root to an empty or dedicated "
                "directory (it is created if missing)"
            )
        _write_marker(rfd, root, fsync, layout)
        return
    version = info.get("format") if isinstance(info, dict) else None
    if version == fmt.FORMAT_VERSION and info.get("layout") != layout:
        held, asked = _layout_option(info.get("layout")), _layout_option(layout)
        raise FileRootError(
            f"file backend root {root!r} holds pages in the {held!r} layout, but this store was "
            f"opened with layout {asked!r}; set options.layout to {held!r}, point options.root at "
            "another directory, or delete this one (its pages are a cache: the engine recomputes "
            "what is missing)"
        )
    if version != fmt.FORMAT_VERSION:
        raise FileRootError(
            f"file backend root {root!r} holds pages in format {version!r}, but this "
            f"hicache-file reads and writes format {fmt.FORMAT_VERSION} only"
            + (
                " (format 1 came from hicache-file 0.1, before payloads were 64-byte aligned)"
                if version == 1
                else ""
            )
            + "; point options.root at another directory, or delete this one (its pages are a "
            "cache: the engine recomputes what is missing)"
        )


def _layout_option(marker_layout: object) -> str:
    """The ``options.layout`` value that opens a root whose marker names ``marker_layout``."""
    return "files" if marker_layout == fmt.LAYOUT else str(marker_layout)


def _write_marker(rfd: int, root: str, fsync: bool, layout: str) -> None:
    """Write the marker through a temp file renamed over it; a failure (a full disk) leaves
    nothing behind and raises :class:`FileRootError`."""
    data = json.dumps({"format": fmt.FORMAT_VERSION, "layout": layout, "checksum": "xxh3_64"}).encode()
    tmp = temp_name(fmt.MARKER_NAME + ".")
    try:
        fd = os.open(tmp, _CREATE, 0o644, dir_fd=rfd)
        try:
            try:
                with open(fd, "wb", buffering=0, closefd=False) as f:
                    view = memoryview(data)
                    while view:
                        view = view[f.write(view) or 0 :]
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, fmt.MARKER_NAME, src_dir_fd=rfd, dst_dir_fd=rfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=rfd)
            raise
        if fsync:
            os.fsync(rfd)
    except OSError as err:
        raise FileRootError(
            f"file backend root {root!r}: cannot write {fmt.MARKER_NAME}: [Errno {err.errno}] "
            f"{err.strerror or err}; free space on that filesystem or set options.root elsewhere"
        ) from None
