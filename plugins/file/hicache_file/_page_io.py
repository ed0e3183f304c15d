"""The per-page I/O of :class:`hicache_file.FileBackend`: one range of a batch, on one thread.

Every page is named relative to its shard directory's fd (:mod:`hicache_file._dirs`): opened
with ``O_NOFOLLOW``, checked with ``faccessat(AT_SYMLINK_NOFOLLOW)``, published with
``linkat``/``renameat`` and removed with ``unlinkat``; nothing below the root is followed.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import _format as fmt
from ._dirs import ABSENT, O_CLOEXEC, O_NOFOLLOW, Dir
from ._stats import _Tally

if TYPE_CHECKING:
    from ._dirs import DirTree
    from ._index import LruIndex
    from ._options import FileOptions
    from ._pool_io import Post
    from ._publish import Publisher

__all__ = ["PageIo"]

log = logging.getLogger("hicache.file")

# O_NONBLOCK: a FIFO planted at a page's name must not block a reader (no effect on files)
_RFLAGS = os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
_FH = fmt.FIXED_HEADER
SPLIT = 128 << 10
"""A payload of at least this many bytes (in one buffer) is read header first, alone, then in
pieces (:func:`_read_pieces`); smaller ones, and ``layer_first`` pages, with one ``readv``."""
PIECE = 256 << 10
"""The piece size of :func:`_read_pieces`: each piece is checksummed right after its read,
while it is still in the CPU's cache."""

# Why the header alone first: the first read of a file that is not cached sets the kernel's
# readahead for it. A first read of the whole file is one synchronous readahead into single
# 4 KiB folios, and every later read of the page then pays per 4 KiB folio (page-cache lookup,
# and moving it to the active LRU list on its second use); a one-page first read starts the
# readahead small, and the kernel grows it asynchronously, in ever larger folios, while the
# payload is copied and checked (a 1 MiB file: 18 folios instead of 257; 128 KiB: 11 instead of
# 33). The extra read costs on every read (about 5 % of a cached 128 KiB payload's time) and,
# from disk, a second wait; below SPLIT that costs more than the folios bring. Measured in
# benchmarks/README.md ("Twelfth session, 2026-11-26: the files layout's warm read").


class PageIo:
    """Mixin of :class:`~hicache_file.FileBackend`: the page loops its batches run."""

    _tree: DirTree
    _publisher: Publisher
    _fsync: bool
    index: LruIndex | None
    options: FileOptions
    root: str

    def _recheck(self, keys: Sequence[str], dirs: list[Dir], fds: list[int], found: list[bool]) -> None:
        """Look again for the keys ``exists`` missed in a directory removed (and maybe made
        again) since its fd was cached; updates ``found`` in place."""
        checked: dict[Dir, int] = {}
        access, f_ok = os.access, os.F_OK
        for i, f in enumerate(found):
            if not f and fds[i] >= 0:
                try:
                    fd = self._fresh_fd(dirs[i], fds[i], checked)
                    found[i] = access(keys[i], f_ok, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue

    def _fresh_fd(self, d: Dir, fd: int, checked: dict[Dir, int]) -> int:
        """After a miss in ``d`` through ``fd``: ``d``'s fd if it changed since (the directory
        was removed, and maybe made again); else raise ``FileNotFoundError`` (a plain miss).

        One ``fstat`` per directory per range (``checked``), only on misses."""
        new = checked.get(d)
        if new is None:
            try:
                new = self._tree.refresh(d, False) if fd >= 0 else ABSENT
            except OSError:
                new = ABSENT
            checked[d] = new
        if new == fd or new < 0:
            raise FileNotFoundError(errno.ENOENT, "no such page")
        return new

    def _get_range(
        self,
        keys: Sequence[str],
        dirs: list[Dir],
        fds: list[int],
        errs: dict[Dir, OSError],
        iovs: list[list[Any]],
        sizes: list[int],
        posts: list[Post | None] | None,
        lo: int,
        hi: int,
    ) -> tuple[list[bool], _Tally]:
        tally = _Tally()
        out: list[bool] = []
        hits = misses = nbytes = 0
        checksum, xxh3 = fmt.checksum, fmt.xxh3_64
        parts = fmt.header_parts
        split = SPLIT
        spare = bytearray(1)  # a byte read into it means trailing garbage
        track = self.index is not None
        osopen, rflags, readv = os.open, _RFLAGS, os.readv
        checked: dict[Dir, int] = {}
        for j in range(lo, hi):
            key, dfd, iov, size = keys[j], fds[j], iovs[j], sizes[j]
            kb = key.encode("ascii")
            fixed, pad = parts(len(kb), size)  # the valid header: fixed (checksum aside) + kb + pad
            hsize = _FH + len(kb) + len(pad)
            ident = None
            try:
                try:
                    if dfd < 0:
                        raise errs.get(dirs[j]) or FileNotFoundError(errno.ENOENT, "no shard directory")
                    fd = osopen(key, rflags, dir_fd=dfd)
                except FileNotFoundError:  # a miss; or was the directory removed meanwhile?
                    dfd = self._fresh_fd(dirs[j], dfd, checked)
                    fd = osopen(key, rflags, dir_fd=dfd)
            except FileNotFoundError:
                misses += 1
                out.append(False)
                continue
            except OSError as err:
                if err.errno == errno.ELOOP and dfd >= 0 and (ident := _symlink(dfd, key)) is not None:
                    out.append(False)  # a symlink where a page belongs: never followed
                    self._quarantine(dfd, key, dirs[j], ident, "a symlink, not a page", tally)
                    tally.gone.append(key)
                    continue
                tally.error("read_errors", err, _path(dirs[j], key))
                out.append(False)
                continue
            reason: str | None = "?"
            try:
                hdr = bytearray(hsize)
                if size >= split and len(iov) == 1:
                    nread, digest = readv(fd, [hdr]), None  # the header alone first (see SPLIT)
                    if nread == hsize and hdr[:16] == fixed[:16] and hdr[_FH:] == kb + pad:
                        got, digest = _read_pieces(fd, iov[0], size, spare)
                        nread += got
                else:
                    nread, digest = readv(fd, [hdr, *iov, spare]), None
                if (
                    nread == hsize + size
                    and hdr[:16] == fixed[:16]
                    and hdr[_FH:] == kb + pad
                    and int.from_bytes(hdr[16:24], "little")
                    == (digest if digest is not None else xxh3(iov[0]) if len(iov) == 1 else checksum(iov))
                ):
                    reason = None
                else:
                    st = os.fstat(fd)
                    reason = fmt.classify(hdr, nread, kb, size, st.st_size)
                    if reason is not None:
                        ident = (st.st_dev, st.st_ino)
                    else:
                        tally.add("size_mismatches")
                        reason = ""
            except OSError as err:
                tally.error("read_errors", err, _path(dirs[j], key))
                out.append(False)
                continue
            finally:
                os.close(fd)
            if reason is None:
                if posts is not None and posts[j] is not None:
                    dst, scratch = posts[j]  # type: ignore[misc]
                    dst.copy_(scratch.view(dst.shape))
                hits += 1
                nbytes += size
                if track:
                    tally.touched.append((key, hsize + size))
                out.append(True)
                continue
            out.append(False)
            if reason:
                self._quarantine(dfd, key, dirs[j], ident, reason, tally)
                tally.gone.append(key)
        tally.add("hits", hits)
        tally.add("misses", misses)
        tally.add("bytes_read", nbytes)
        return out, tally

    def _quarantine(
        self, dfd: int, key: str, d: Dir, ident: tuple[int, int] | None, reason: str, tally: _Tally
    ) -> None:
        """Count, log and delete a corrupt page (only if it is still the file we read)."""
        tally.add("integrity_errors")
        try:
            st = os.stat(key, dir_fd=dfd, follow_symlinks=False)
            if ident is None or (st.st_dev, st.st_ino) == ident:
                os.unlink(key, dir_fd=dfd)
                removed = "removed"
            else:
                removed = "kept (replaced meanwhile by a new page)"
        except OSError as err:
            removed = f"could not remove: {err.strerror or err}"
        log.warning("hicache.file: corrupt page %s (%s): read as a miss, %s", _path(d, key), reason, removed)

    def _set_range(
        self,
        keys: Sequence[str],
        dirs: list[Dir],
        fds: list[int],
        errs: dict[Dir, OSError],
        iovs: list[list[Any]],
        sizes: list[int],
        absent: frozenset[str] | set[str],
        tmp: tuple[int, OSError | None],
        lo: int,
        hi: int,
    ) -> tuple[list[bool], _Tally]:
        tally = _Tally()
        out: list[bool] = []
        writes = skipped = nbytes = 0
        checksum, header, xxh3 = fmt.checksum, fmt.encode_header, fmt.xxh3_64
        access, f_ok = os.access, os.F_OK
        publish = self._publisher.publish
        track = self.index is not None
        budget = self.options.max_bytes
        tree = self._tree
        tmpfd, tmperr = tmp
        fsync_dirs: dict[int, list[int]] = {}
        for j in range(lo, hi):
            key, dfd, iov, size = keys[j], fds[j], iovs[j], sizes[j]
            kb = key.encode("ascii")
            disk = fmt.header_size(len(kb)) + size
            # Skip present keys; a key this thread's last exists() found absent needs no second
            # look (if another process wrote it since, publish() keeps that copy or replaces
            # it with identical bytes: both fine).
            if key not in absent and dfd >= 0 and access(key, f_ok, dir_fd=dfd, follow_symlinks=False):
                skipped += 1
                if track:
                    tally.touched.append((key, disk))
                out.append(True)
                continue
            if budget is not None and disk > budget:
                err = OSError(errno.EFBIG, f"page exceeds max_bytes={budget}")
                tally.error("write_errors", err, _path(dirs[j], key))
                out.append(False)
                continue
            try:
                if dfd < 0 or tmperr is not None:
                    raise errs.get(dirs[j]) or tmperr or OSError(errno.ENOENT, "no directory")
                digest = xxh3(iov[0]) if len(iov) == 1 else checksum(iov)
                bufs = [header(kb, size, digest), *iov]
                for attempt in range(3):
                    try:
                        fresh = publish(dfd, key, bufs, disk, tmpfd)
                        break
                    except OSError as err:  # was a directory removed meanwhile (a clear)?
                        # (O_TMPFILE/linkat in a removed directory: ENOENT or EPERM)
                        if attempt == 2:
                            raise
                        try:  # the same fds if the directories are still there
                            fresh_fds = (
                                tree.refresh(dirs[j], True),
                                (tree.refresh(tree.tmp, True) if tmpfd >= 0 else tmpfd),
                            )
                        except OSError:
                            raise err from None
                        if fresh_fds == (dfd, tmpfd):
                            raise
                        dfd, tmpfd = fresh_fds
            except OSError as err:
                tally.error("write_errors", err, _path(dirs[j], key))
                out.append(False)
                continue
            if fresh:
                writes += 1
                nbytes += size
            else:
                skipped += 1
            if track:
                tally.touched.append((key, disk))
            if self._fsync and fresh:
                fsync_dirs.setdefault(dfd, []).append(len(out))
            out.append(True)
        for dfd, positions in fsync_dirs.items():
            try:
                os.fsync(dfd)  # the shard directory: its new names survive a power loss
            except OSError as err:
                tally.error("write_errors", err, self.root)
                for p in positions:
                    out[p] = False
        tally.add("writes", writes)
        tally.add("skipped_writes", skipped)
        tally.add("bytes_written", nbytes)
        return out, tally


def _read_pieces(fd: int, view: Any, size: int, spare: bytearray) -> tuple[int, int | None]:
    """Read a ``size``-byte payload from ``fd``'s position into ``view`` in pieces of
    :data:`PIECE` bytes, and at most one byte more into ``spare`` (a byte there means trailing
    data). Returns ``(bytes read, xxh3_64 of the payload)``, the digest ``None`` when the file
    ended early.

    Reading then hashing a whole payload of megabytes streams it through memory twice (the
    kernel's copy into ``view``, then the hash); hashing each piece just after its copy reads it
    from the CPU's cache. The digest equals :data:`~hicache_file._format.xxh3_64` of the payload
    (a streaming hash of the same bytes), so the caller's check is unchanged."""
    readv, step = os.readv, PIECE
    if size <= step:  # one piece: the one-shot hash, no streaming state
        nread = readv(fd, [view, spare])
        return nread, (fmt.xxh3_64(view) if nread == size else None)
    h = fmt.xxh3_stream()
    nread = 0
    for off in range(0, size, step):
        part = view[off : off + step]
        want = len(part)
        got = readv(fd, [part, spare] if off + want == size else [part])
        nread += got
        if got < want:
            return nread, None
        h.update(part)
    return nread, h.intdigest()


def _path(d: Dir, key: str) -> str:
    """The page's path, for messages."""
    return f"{d.path}/{key}"


def _symlink(dfd: int, key: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``key`` in ``dfd`` if it is a symlink."""
    try:
        st = os.stat(key, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISLNK(st.st_mode) else None
