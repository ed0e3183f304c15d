"""``FileBackend``: the embedded default hicache backend.

Two layouts (``options.layout``): ``"files"``, one file per component key (this module and
:mod:`hicache_file._page_io`; format in :mod:`hicache_file._format`), and ``"segments"``, pages
appended to segment files with per-writer index logs (every batch goes to
:class:`hicache_file._segments.SegmentStore`; format in :mod:`hicache_file._seglog`). See
``plugins/file/README.md`` for the options. Summary of the guarantees of ``"files"``:

* ``set`` publishes each key atomically (an unnamed ``O_TMPFILE`` inode linked to its name,
  or a temp file renamed over it; optional fsync; see :mod:`hicache_file._publish`): a reader
  sees the old state (absent) or the whole page, never a torn one. A failing key (ENOSPC,
  EIO, permissions) is ``False`` for that key only, leaves no temp file and is logged once
  per batch. Keys already present are skipped and reported ``True``.
* ``get`` reads header and payload straight into the host pool (one ``readv``; from 128 KiB,
  the header alone first, then the payload in pieces, see :mod:`hicache_file._page_io`) and
  verifies magic, format, key, length and the xxh3_64 checksum. A corrupt, truncated or
  misplaced file is a miss (``False``), counted in :attr:`FileBackend.stats`
  ``.integrity_errors``, logged, and deleted so the next backup rewrites it. A valid page of
  another size is a plain miss.
* ``exists`` is one ``faccessat(2)`` per key, by name in its shard directory: no directory
  scan, ever.
* Nothing below the root is reached through a symlink: every directory and page is opened,
  created, linked, renamed and removed relative to the fd of its parent directory with
  ``O_NOFOLLOW`` (see :mod:`hicache_file._dirs`). Keys are exact ``str`` and checked
  (:func:`hicache_core.check_key`) at the hooks themselves, whoever calls them.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from itertools import chain
from operator import countOf
from typing import TYPE_CHECKING, Any

from hicache_core import (
    BatchShapeError,
    Capabilities,
    DraftIo,
    DraftIoMode,
    IoOp,
    KeyFormatError,
    PoolError,
    PoolName,
    check_key,
    check_keys,
    hookimpl,
)

if TYPE_CHECKING:  # heavy (torch / pydantic); annotations only
    from hicache_core import HostPool, PoolTransfer, StorageConfig

    from ._segments import SegmentStore

from . import _format as fmt
from ._clear import clear_namespace
from ._dirs import ABSENT, Dir
from ._index import LruIndex, scan_root
from ._options import FileOptions
from ._page_io import PageIo
from ._pool_io import PoolIo, Post, tensor_iov
from ._publish import open_root
from ._stats import FileStats, _Tally

__all__ = ["FileBackend"]

log = logging.getLogger("hicache.file")

_PATH_CACHE_MAX = 1 << 15
_FD = operator.attrgetter("fd")


class FileBackend(PageIo):
    """Pages as files under ``options.root`` (see the module docstring for the guarantees)."""

    Options = FileOptions
    capabilities = Capabilities(
        v1=True,
        v2=True,
        zero_copy=False,
        pools=frozenset(PoolName),
        persistent=True,
        shared=True,
        draft_io=DraftIoMode.GENERIC,
        # set skips a stored page itself (one faccessat(2) on its I/O thread, no bytes written), so
        # backup needs no separate existence pass; exact_skipped turns the pass back on
        set_skips_existing=True,
    )

    def __init__(self, config: StorageConfig, options: FileOptions) -> None:
        self.config = config
        self.options = options
        if options.exact_skipped:  # backup checks existence first: exact TransferResult.skipped
            self.capabilities = dataclasses.replace(type(self).capabilities, set_skips_existing=False)
        segments = options.layout == "segments"
        tree, self._publisher, swept = open_root(
            options.resolved_root(),
            options.fsync,
            options.publish,
            options.temp_max_age_s,
            "segments" if segments else fmt.LAYOUT,
        )
        self._tree = tree
        self._finalizer = weakref.finalize(self, tree.close)
        self.root = tree.root  # resolved once: the configured root may be a symlink
        self._prefix = self.root.rstrip("/") + "/"
        self._fsync = options.fsync
        self._absent = threading.local()  # keys the last exists() of a thread found absent
        self._path_cache: dict[str, Dir] = {}  # validated key -> its shard directory
        self._valid: set[str] = set()  # layout "segments": keys checked already
        self._pools: dict[PoolName, PoolIo] = {}
        self._stats = FileStats(temp_files_removed=swept)
        self._stats_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._closed = False
        self.index: LruIndex | None = None
        self.scan_seconds = 0.0  # the open-time scan (only with max_bytes)
        self.segments: SegmentStore | None = None  # layout "segments": every batch goes there
        if segments:
            from ._segmap import close_all  # the segment modules load only for a segments store
            from ._segments import SegmentStore

            pool = weakref.WeakMethod(self._pool)  # the finalizer below must not keep self alive
            try:
                self.segments = SegmentStore(
                    tree.root,
                    tree.top.fd,
                    options,
                    self._stats,
                    self._stats_lock,
                    lambda: (m := pool()) and m(),
                    partial(tree.refresh, tree.top, False),
                )
            except BaseException:
                tree.close()
                raise
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, partial(close_all, tree, self.segments))
        elif options.max_bytes is not None:
            self.index = LruIndex(options.max_bytes)
            scan = scan_root(tree, options.temp_max_age_s)
            self.index.load(scan.entries)
            self._stats.temp_files_removed += scan.temp_removed
            self.scan_seconds = scan.seconds
            self._evict()

    # ------------------------------------------------------------------ info
    @classmethod
    def availability(cls) -> str | None:
        return None

    @property
    def stats(self) -> FileStats:
        """A snapshot of the counters (``integrity_errors``, ``hits``, ``evictions``...)."""
        with self._stats_lock:
            return FileStats(**asdict(self._stats))

    @property
    def integrity_errors(self) -> int:
        return self._stats.integrity_errors

    @property
    def publish_mode(self) -> str:
        """``"tmpfile"`` (O_TMPFILE + linkat) or ``"rename"`` (temp file + rename)."""
        return "tmpfile" if self._publisher.anonymous else "rename"

    def path_of(self, key: str) -> str:
        """Absolute path of ``key``'s page file below the resolved root (validates the key; the
        file may not exist). For tools and tests: the backend itself never opens it by path."""
        return self._prefix + fmt.relpath(check_key(key))

    def __repr__(self) -> str:
        return f"FileBackend(root={self.root!r}, max_bytes={self.options.max_bytes})"

    # ----------------------------------------------------------------- hooks
    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> None:
        self._pools[PoolName(pool_name)] = PoolIo(pool)

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        return DraftIo(
            DraftIoMode.GENERIC,
            "the file backend copies draft pages through v1 under their own keys",
        )

    @hookimpl
    def hicache_batch_io_v1(
        self,
        op: IoOp,
        keys: Sequence[str],
        buffers: Sequence[Any] | None,
        pool_name: PoolName | None = None,  # unused (pluggy does not pass it): for direct calls
    ) -> list[bool]:
        """Per-key exists/get/set; ``buffers`` are uint8 CPU views (strided ones allowed)."""
        op = IoOp(op)
        if not keys:
            return []
        if op is IoOp.EXISTS:
            return self._batch(op, keys, [], [], None)
        if buffers is None or len(buffers) != len(keys):
            raise BatchShapeError(
                f"file backend {op.value}: {len(keys)} keys but "
                f"{'no' if buffers is None else len(buffers)} buffers; pass one buffer per key"
            )
        iovs: list[list[Any]] = []
        sizes: list[int] = []
        posts: list[Post | None] = []
        for b in buffers:
            iov, post = tensor_iov(b, op is IoOp.GET)
            iovs.append(iov)
            sizes.append(b.numel())
            posts.append(post)
        return self._batch(op, keys, iovs, sizes, posts if any(p is not None for p in posts) else None)

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        """Every component of every page of every transfer in one parallel batch."""
        op = IoOp(op)
        keys: list[str] = []
        iovs: list[list[Any]] = []
        sizes: list[int] = []
        posts: list[Post | None] | None = None
        shape: list[tuple[int, int]] = []
        for t in transfers:
            n = len(t)
            pio = self._pools.get(t.pool)
            if pio is None:
                raise PoolError(
                    f"pool {t.pool.value!r} is not registered with the file backend; registered: "
                    f"{[p.value for p in self._pools]}"
                )
            shape.append((n, pio.ncomp))
            if n == 0:
                continue
            if len(t.keys) != n:
                raise BatchShapeError(
                    f"PoolTransfer({t.pool.value}) has {len(t.keys)} key tuples for {n} pages; "
                    "resolve keys with store.page_keys() (the controller does this)"
                )
            widths = set(map(len, t.keys))
            if widths != {pio.ncomp}:
                raise BatchShapeError(
                    f"PoolTransfer({t.pool.value}): pages have {sorted(widths)} keys but the pool has "
                    f"{pio.ncomp} components {list(pio.pool.components)}"
                )
            keys.extend(chain.from_iterable(t.keys))
            if op is not IoOp.EXISTS:
                views, post = pio.iovs(t.host_indices, op is IoOp.GET)
                iovs.extend(views)
                sizes.extend(pio.sizes * n)
                if post is not None or posts is not None:
                    posts = (posts or [None] * (len(iovs) - len(views))) + (post or [None] * len(views))
        flat = self._batch(op, keys, iovs, sizes, posts, shape) if keys else []
        out: list[list[bool]] = []
        off = 0
        for n, c in shape:
            part = flat[off : off + n * c]
            if c == 1:
                out.append(part)
            elif c == 2:
                out.append(list(map(operator.and_, part[0::2], part[1::2])))
            else:
                out.append([all(part[i : i + c]) for i in range(0, n * c, c)])
            off += n * c
        return out

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        """Delete every page whose key starts with ``namespace + "."``; return how many.

        Only that namespace's directory is walked; other namespaces are untouched. Clearing a
        whole namespace also removes its temp files (not counted; a writer racing with the
        clear may then fail that key). Files that cannot be removed are logged, not raised.
        Raises :class:`KeyFormatError` for a namespace that is not a safe key prefix.
        """
        check_key(namespace)
        prefix = namespace + "."
        if self.segments is not None:
            self.segments._enter()
            try:
                removed = self.segments.clear(prefix)
            finally:
                self.segments._leave()
            with self._stats_lock:
                self._stats.cleared += removed
            log.info("hicache.file: cleared namespace %r under %s: %d pages", namespace, self.root, removed)
            return removed
        tree = self._tree
        tree.enter()
        try:
            removed, temps, failed, first_error = clear_namespace(tree, namespace)
            tree.forget(namespace.partition(".")[0])  # its directories may be gone now
        finally:
            tree.leave()
        if self.index is not None:
            self.index.drop_prefix(prefix)
        with self._stats_lock:
            self._stats.cleared += removed
            self._stats.temp_files_removed += temps
        log.info("hicache.file: cleared namespace %r under %s: %d pages", namespace, self.root, removed)
        if failed:
            log.warning("hicache.file: clear could not remove %d files; first: %s", failed, first_error)
        elif first_error:
            log.warning("hicache.file: clear did not enter %s", first_error)
        return removed

    @hookimpl
    def hicache_close(self) -> None:
        """Stop the I/O threads (waits for the batch in flight). Idempotent.

        A closed backend still answers, in the caller's thread only.
        """
        self._closed = True
        with self._executor_lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)
        if self.segments is not None:
            self.segments.close()
        self._tree.release(root=True)  # closed once no batch runs; opened again if still used

    # ------------------------------------------------------------- batching
    def _locate(self, keys: Sequence[str]) -> list[Dir]:
        """Validate keys and map each to its shard directory; raises :class:`KeyFormatError`.

        Every key must be an exact ``str`` (a subclass's ``__str__`` or ``__fspath__`` could
        name another file): one C-level type count per batch. Checking a key's characters
        (:func:`check_key`) and finding its directory cost ~0.8 us, more than the ``faccessat(2)``
        that follows, and every key is looked up several times in quick succession (backup:
        exists then set; query then prefetch: exists, exists, get). So validated keys are
        memoised with their directory in a bounded dict (the mapping is pure; it is emptied
        when it reaches ``_PATH_CACHE_MAX`` entries, a few MB).
        """
        if countOf(map(type, keys), str) != len(keys):
            for k in keys:
                check_key(k)  # raises for the first key that is not an exact str
            raise KeyFormatError("storage keys must be exact str objects")  # pragma: no cover
        cache = self._path_cache
        out: list[Dir | None] = list(map(cache.get, keys))
        if None not in out:
            return out  # type: ignore[return-value]
        if len(cache) + len(out) > _PATH_CACHE_MAX:
            cache.clear()
        new = out.count(None) == len(out)
        if new:
            check_keys(keys)  # a batch of new keys (a backup's): one regex pass
        tree = self._tree
        dirs = tree._dirs
        for i, d in enumerate(out):
            if d is None:
                k = keys[i]
                if not new:
                    check_key(k)
                dot = k.find(".")
                last = k[-1]
                loc = (k[:dot] if dot > 0 else "_", "_" if last == "." else last)
                d = dirs.get(loc) or tree.dir(*loc)
                out[i] = cache[k] = d
        return out  # type: ignore[return-value]

    def _pool(self) -> ThreadPoolExecutor | None:
        if self._closed:
            return None
        ex = self._executor
        if ex is None:
            with self._executor_lock:
                if self._executor is None and not self._closed:
                    n = self.options.io_threads  # segments: more O_DIRECT runs in flight (_segio)
                    n = max(n, 8) if self.options.layout == "segments" else n
                    self._executor = ThreadPoolExecutor(n - 1, thread_name_prefix="hicache-file")
                ex = self._executor
        return ex

    def _batch(
        self,
        op: IoOp,
        keys: Sequence[str],
        iovs: list[list[Any]],
        sizes: list[int],
        posts: list[Post | None] | None,
        shape: list[tuple[int, int]] | None = None,
    ) -> list[bool]:
        if self.segments is not None:
            return self._seg_batch(op, keys, iovs, sizes, posts, shape)
        dirs = self._locate(keys)
        tree = self._tree
        tree.enter()
        try:
            return self._batch_in(op, keys, dirs, iovs, sizes, posts)
        finally:
            tree.leave()

    def _batch_in(
        self,
        op: IoOp,
        keys: Sequence[str],
        dirs: list[Dir],
        iovs: list[list[Any]],
        sizes: list[int],
        posts: list[Post | None] | None,
    ) -> list[bool]:
        n = len(keys)
        tree = self._tree
        rename = op is IoOp.SET and not self._publisher.anonymous
        # the fd of each key's directory as cached; directories not open yet (or absent when
        # last looked at) are opened (made, for a set) first. A cached fd whose directory was
        # removed meanwhile (a clear, maybe in another process) shows up as ENOENT: a set opens
        # it again and retries, a miss in exists/get looks again (_recheck, _fresh_fd).
        fds = list(map(_FD, dirs))
        tmpfd = tree.tmp.fd if rename else ABSENT
        errs: dict[Dir, OSError] = {}
        if n and (min(fds) < 0 or (rename and tmpfd < 0)):
            want = {d for d, fd in zip(dirs, fds) if fd < 0}
            if rename and tmpfd < 0:
                want.add(tree.tmp)
            fdmap, errs = tree.prepare(want, op is IoOp.SET)
            fds = [fd if fd >= 0 else fdmap[d] for d, fd in zip(dirs, fds)]
            if rename and tmpfd < 0:
                tmpfd = fdmap[tree.tmp]
        if op is IoOp.EXISTS:
            access, f_ok = os.access, os.F_OK
            found = [
                fd >= 0 and access(k, f_ok, dir_fd=fd, follow_symlinks=False) for k, fd in zip(keys, fds)
            ]
            if not all(found):
                self._recheck(keys, dirs, fds, found)
            self._absent.keys = {k for k, f in zip(keys, found) if not f}
            with self._stats_lock:
                self._stats.exists_checks += n
            return found
        threads = self.options.io_threads
        parallel = (
            threads > 1 and n > 1 and not self._closed and sum(sizes) >= self.options.parallel_min_bytes
        )
        work: Any
        args: tuple[Any, ...]
        if op is IoOp.GET:
            work, args = self._get_range, (keys, dirs, fds, errs, iovs, sizes, posts)
        else:
            absent = getattr(self._absent, "keys", None) or frozenset()
            self._absent.keys = None
            tmp = (tmpfd, errs.get(tree.tmp))
            work, args = self._set_range, (keys, dirs, fds, errs, iovs, sizes, absent, tmp)
        ex = self._pool() if parallel else None
        if ex is None:
            parts = [work(*args, 0, n)]
        else:
            k = min(threads, n)
            bounds = [n * i // k for i in range(k + 1)]
            futures: list[Future[tuple[list[bool], _Tally]]] = [
                ex.submit(partial(work, *args, bounds[i], bounds[i + 1])) for i in range(1, k)
            ]
            try:
                parts = [work(*args, bounds[0], bounds[1])]
            finally:  # never return while a worker still touches the caller's buffers
                parts_rest = [f.result() for f in futures]
            parts += parts_rest
        result: list[bool] = []
        for flags, _ in parts:
            result += flags
        self._finish(op, n, [t for _, t in parts])
        return result

    def _seg_batch(
        self,
        op: IoOp,
        keys: Sequence[str],
        iovs: list[list[Any]],
        sizes: list[int],
        posts: list[Post | None] | None,
        shape: list[tuple[int, int]] | None,
    ) -> list[bool]:
        from ._segmap import check_key_batch, page_groups

        seg = self.segments
        assert seg is not None
        check_key_batch(keys, self._valid)
        seg._enter()  # close() closes no fd while a batch may use it
        try:
            if op is IoOp.EXISTS:
                found = seg.exists(keys)
                counts = {"exists_checks": len(keys)}
            elif op is IoOp.GET:
                found, counts = seg.get(keys, iovs, sizes, posts)
                counts["gets"] = len(keys)
            else:
                found, counts = seg.set(keys, iovs, sizes, page_groups(keys, shape))
                counts["sets"] = len(keys)
        finally:
            seg._leave()
        with self._stats_lock:
            st = self._stats
            for name, v in counts.items():
                setattr(st, name, getattr(st, name) + v)
        return found

    def _finish(self, op: IoOp, n: int, tallies: list[_Tally]) -> None:
        errors = sum(t.errors for t in tallies)
        with self._stats_lock:
            st = self._stats
            if op is IoOp.GET:
                st.gets += n
            else:
                st.sets += n
            for t in tallies:
                for name, v in t.counts.items():
                    setattr(st, name, getattr(st, name) + v)
        if errors:
            first = next(t.first_error for t in tallies if t.first_error)
            log.warning(
                "hicache.file: %d of %d %s operations failed under %s (those keys report False); first: %s",
                errors,
                n,
                op.value,
                self.root,
                first,
            )
        if self.index is not None:
            for t in tallies:
                self.index.touch(t.touched)
                self.index.discard(t.gone)
            self._evict()

    def _evict(self) -> None:
        assert self.index is not None
        victims = self.index.victims()
        if not victims:
            return
        tree = self._tree
        located = [(key, size, tree.dir(*fmt.location(key))) for key, size in victims]
        gone = nbytes = 0
        tree.enter()
        try:
            fdmap, errs = tree.prepare({d for _, _, d in located}, False)
            for key, size, d in located:
                fd = fdmap[d]
                try:
                    if fd < 0:
                        err = errs.get(d)
                        if err is None:
                            continue  # its directory is gone: evicted or cleared elsewhere already
                        raise err
                    os.unlink(key, dir_fd=fd)  # unlinkat: removes the name, never follows it
                except FileNotFoundError:
                    continue  # evicted or cleared by another process already
                except OSError as err:  # the budget is best effort; never fail the batch for it
                    log.warning("hicache.file: cannot evict %s: %s", key, err)
                    continue
                gone += 1
                nbytes += size
        finally:
            tree.leave()
        with self._stats_lock:
            self._stats.evictions += gone
            self._stats.evicted_bytes += nbytes
        log.debug("hicache.file: evicted %d pages (%d bytes) to fit max_bytes", gone, nbytes)
