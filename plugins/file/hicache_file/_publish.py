"""Atomic publication of one page file, and the root directory checks done at open time.

Two ways to make a complete file appear under its final name in one step:

* ``O_TMPFILE`` (Linux; ext4, xfs, btrfs, tmpfs): write an unnamed inode in the shard
  directory, then ``linkat`` it to its name through ``/proc/self/fd``. The name appears
  atomically with the whole content; a writer killed before the link leaves nothing behind
  (the kernel frees the inode); ``EEXIST`` means another writer published the key first, and
  its page is kept. One directory insertion per page, like a plain ``open(O_CREAT)``.
* temp file + ``rename`` (portable fallback, chosen when the probe at open fails, e.g. NFS):
  ``.tmp-<token>-<pid>-<n>`` in the shard directory, renamed over the final name. A killed
  writer may leave a temp file (never read as a page; swept by ``clear`` and the open-time
  scan after ``temp_max_age_s``).

Either way the final name only ever points at a complete page.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import secrets
from typing import Any

from . import _format as fmt
from ._errors import FileRootError

__all__ = ["Publisher", "fsync_dir", "open_root"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
_ANON = os.O_WRONLY | _O_TMPFILE | _O_CLOEXEC
# linkat() ignores the directory fd of an absolute path; passing one (any value other than
# AT_FDCWD) makes CPython call linkat(..., AT_SYMLINK_FOLLOW) instead of link(), which is
# what following /proc/self/fd/N to the open inode needs.
_ABSOLUTE = -1


class Publisher:
    """Writes ``header + payload`` and publishes it under its final name, atomically."""

    def __init__(self, anonymous: bool, fsync: bool) -> None:
        self.anonymous = anonymous
        self.fsync = fsync
        self._token = secrets.token_hex(4)
        self._seq = itertools.count()

    def publish(self, d: str, path: str, bufs: list[Any], total: int) -> bool:
        """Write ``bufs`` (``total`` bytes) into shard directory ``d`` and publish as ``path``.

        Returns ``False`` when another writer published ``path`` first (its page is kept; the
        caller reports the key as present). Raises ``OSError`` on failure, after removing any
        temp file: the final name never holds a partial page.
        """
        if self.anonymous:
            fd = self._open(d, d, _ANON)
            try:
                self._write(fd, bufs, total)
                try:
                    os.link(f"/proc/self/fd/{fd}", path, src_dir_fd=_ABSOLUTE)
                except FileExistsError:
                    return False
            finally:
                os.close(fd)
            return True
        tmp = f"{d}{fmt.TEMP_PREFIX}{self._token}-{os.getpid()}-{next(self._seq)}"
        fd = self._open(d, tmp, _CREATE)
        try:
            try:
                self._write(fd, bufs, total)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return True

    def _open(self, d: str, target: str, flags: int) -> int:
        for attempt in range(3):  # the shard may be missing, or removed by a racing clear
            try:
                return os.open(target, flags, 0o644)
            except FileNotFoundError:
                if attempt == 2:
                    raise
                self.makedirs(d)
        raise AssertionError("unreachable")  # pragma: no cover

    def _write(self, fd: int, bufs: list[Any], total: int) -> None:
        n = os.writev(fd, bufs)
        if n != total:
            _write_rest(fd, bufs, n, total)
        if self.fsync:
            os.fsync(fd)

    def makedirs(self, d: str) -> None:
        leaf = d.rstrip("/")
        os.makedirs(leaf, exist_ok=True)
        if self.fsync:  # make the new directory entries durable too
            fsync_dir(os.path.dirname(leaf))
            fsync_dir(os.path.dirname(os.path.dirname(leaf)))


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


def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_root(root: str, fsync: bool, mode: str = "auto") -> Publisher:
    """Create ``root`` if needed, check it is a writable directory, stamp/check the format.

    Returns the :class:`Publisher` for it. ``mode`` ``"auto"``: ``O_TMPFILE`` when a probe
    file can be created and linked that way, else temp file + rename; ``"tmpfile"``: require
    it; ``"rename"``: never use it. Raises :class:`FileRootError`.
    """
    fix = (
        "set options.root to a writable directory (for example "
        '`HICACHE_OPTIONS=\'{"root": "/path/to/cache"}\'`) or fix its permissions'
    )
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as err:
        raise FileRootError(
            f"file backend root {root!r} cannot be created: [Errno {err.errno}] "
            f"{err.strerror or err} ({err.filename or root}); {fix}"
        ) from None
    if not os.path.isdir(root):
        raise FileRootError(f"file backend root {root!r} exists but is not a directory; {fix}")
    probe = os.path.join(root, f"{fmt.TEMP_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(probe, _CREATE, 0o644)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise FileRootError(
            f"file backend root {root!r} is not writable: [Errno {err.errno}] {err.strerror or err}; {fix}"
        ) from None
    _check_marker(root)
    anonymous = mode != "rename" and _anonymous_works(root, probe)
    if mode == "tmpfile" and not anonymous:
        raise FileRootError(
            f"file backend root {root!r} does not support O_TMPFILE + linkat through /proc "
            '(needs Linux, /proc and ext4/xfs/btrfs/tmpfs); set options.publish to "auto" or "rename"'
        )
    return Publisher(anonymous, fsync)


def _anonymous_works(root: str, probe: str) -> bool:
    if not _O_TMPFILE:
        return False
    try:
        fd = os.open(root, _ANON, 0o644)
    except OSError:
        return False  # EOPNOTSUPP / EISDIR / EINVAL: the filesystem has no O_TMPFILE
    try:
        os.write(fd, b"x")
        os.link(f"/proc/self/fd/{fd}", probe, src_dir_fd=_ABSOLUTE)
        os.unlink(probe)
        return True
    except OSError:
        return False  # no /proc, or linkat refused
    finally:
        os.close(fd)


def _check_marker(root: str) -> None:
    marker = os.path.join(root, fmt.MARKER_NAME)
    try:
        with open(marker, encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        info = None
    except (OSError, ValueError) as err:
        raise FileRootError(
            f"file backend root {root!r}: cannot read {fmt.MARKER_NAME}: {err}; delete that file "
            "or use another root"
        ) from None
    if info is None:
        # A root without the marker must be empty (or hold only our temp files): never adopt a
        # directory with other content, whose files LRU eviction or clear could then touch.
        with os.scandir(root) as it:
            foreign = sorted(e.name for e in it if not e.name.startswith((fmt.TEMP_PREFIX, fmt.MARKER_NAME)))
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise FileRootError(
                f"file backend root {root!r} is not empty ({shown}) and has no {fmt.MARKER_NAME}, "
                "so it was not created by hicache-file; set options.root to an empty or dedicated "
                "directory (it is created if missing)"
            )
        tmp = f"{marker}.{os.getpid()}-{secrets.token_hex(4)}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"format": fmt.FORMAT_VERSION, "layout": fmt.LAYOUT, "checksum": "xxh3_64"}, f)
        os.replace(tmp, marker)
        return
    version = info.get("format") if isinstance(info, dict) else None
    if version == fmt.FORMAT_VERSION and info.get("layout") != fmt.LAYOUT:
        raise FileRootError(
            f"file backend root {root!r} holds format-{version} pages in the directory layout "
            f"{info.get('layout')!r}, but this hicache-file uses {fmt.LAYOUT!r}; point "
            "options.root at another directory, or delete this one (its pages are a cache: the "
            "engine recomputes what is missing)"
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
