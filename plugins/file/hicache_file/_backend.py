"""``FileBackend``: the embedded default hicache backend (one file per component key).

See :mod:`hicache_file._format` for the on-disk format and ``plugins/file/README.md`` for the
options. Summary of the guarantees:

* ``set`` publishes each key atomically (an unnamed ``O_TMPFILE`` inode linked to its name,
  or a temp file renamed over it; optional fsync; see :mod:`hicache_file._publish`): a reader
  sees the old state (absent) or the whole page, never a torn one. A failing key (ENOSPC,
  EIO, permissions) is ``False`` for that key only, leaves no temp file and is logged once
  per batch. Keys already present are skipped and reported ``True``.
* ``get`` reads header + payload with one ``readv`` straight into the host pool and verifies
  magic, format, key, length and the xxh3_64 checksum. A corrupt, truncated or misplaced file
  is a miss (``False``), counted in :attr:`FileBackend.stats` ``.integrity_errors``, logged,
  and deleted so the next backup rewrites it. A valid page of another size is a plain miss.
* ``exists`` is one ``access(2)`` per key on a computed path: no directory scan, ever.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import operator
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

from hicache_core import (
    BatchShapeError,
    Capabilities,
    DraftIo,
    DraftIoMode,
    IoOp,
    PoolError,
    PoolName,
    check_key,
    check_keys,
    hookimpl,
)

if TYPE_CHECKING:  # heavy (torch / pydantic); annotations only
    from hicache_core import HostPool, PoolTransfer, StorageConfig

from . import _format as fmt
from ._clear import clear_namespace
from ._index import LruIndex, scan_root
from ._options import FileOptions
from ._pool_io import PoolIo, Post, tensor_iov
from ._publish import fsync_dir, open_root
from ._stats import FileStats, _Tally

__all__ = ["FileBackend"]

log = logging.getLogger("hicache.file")

_RFLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_PATH_CACHE_MAX = 1 << 15
_FH = fmt.FIXED_HEADER


class FileBackend:
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
        # set skips a stored page itself (one access(2) on its I/O thread, no bytes written), so
        # backup needs no separate existence pass; exact_skipped turns the pass back on
        set_skips_existing=True,
    )

    def __init__(self, config: StorageConfig, options: FileOptions) -> None:
        self.config = config
        self.options = options
        if options.exact_skipped:  # backup checks existence first: exact TransferResult.skipped
            self.capabilities = dataclasses.replace(type(self).capabilities, set_skips_existing=False)
        self.root = options.resolved_root()
        self._publisher = open_root(self.root, options.fsync, options.publish)
        self._prefix = self.root.rstrip("/") + "/"
        self._fsync = options.fsync
        self._absent = threading.local()  # keys the last exists() of a thread found absent
        self._path_cache: dict[str, str] = {}
        self._pools: dict[PoolName, PoolIo] = {}
        self._stats = FileStats()
        self._stats_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._closed = False
        self.index: LruIndex | None = None
        self.scan_seconds = 0.0  # the open-time scan (only with max_bytes)
        if options.max_bytes is not None:
            self.index = LruIndex(options.max_bytes)
            scan = scan_root(self.root, options.temp_max_age_s)
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
        """Absolute path of ``key``'s page file (validates the key; the file may not exist)."""
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
    def hicache_batch_io_v1(self, op: IoOp, keys: Sequence[str], buffers: Sequence[Any] | None) -> list[bool]:
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
        flat = self._batch(op, keys, iovs, sizes, posts) if keys else []
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
        removed, temps, failed, first_error = clear_namespace(self._prefix, namespace)
        if self.index is not None:
            self.index.drop_prefix(prefix)
        with self._stats_lock:
            self._stats.cleared += removed
            self._stats.temp_files_removed += temps
        log.info("hicache.file: cleared namespace %r under %s: %d pages", namespace, self.root, removed)
        if failed:
            log.warning("hicache.file: clear could not remove %d files; first: %s", failed, first_error)
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

    # ------------------------------------------------------------- batching
    def _paths(self, keys: Sequence[str]) -> list[str]:
        """Validate keys (:func:`check_key`) and map them to absolute page paths.

        Validation plus formatting costs ~0.8 us per key, more than the ``access(2)`` that
        follows, and every key is looked up several times in quick succession (backup:
        exists then set; query then prefetch: exists, exists, get). So validated keys and
        their paths are memoised in a bounded dict (the mapping is pure; it is emptied when
        it reaches ``_PATH_CACHE_MAX`` entries, a few MB).
        """
        cache = self._path_cache
        try:
            out: list[str | None] = list(map(cache.get, keys))
        except TypeError:  # an unhashable key: not a str
            for k in keys:
                check_key(k)
            raise
        if None in out:
            root = self._prefix
            if len(cache) + len(out) > _PATH_CACHE_MAX:
                cache.clear()
            if out.count(None) == len(out):  # a batch of new keys (a backup's): ~25% faster
                check_keys(keys)
                relpath = fmt.relpath
                paths = [
                    "%s%s/%s/%s" % (root, k[:dot], k[-1], k)  # noqa: UP031
                    if (dot := k.find(".")) > 0 and k[-1] != "."
                    else root + relpath(k)
                    for k in keys
                ]
                cache.update(zip(keys, paths))
                return paths
            for i, p in enumerate(out):
                if p is None:
                    k = keys[i]
                    check_key(k)
                    dot = k.find(".")
                    if dot > 0 and k[-1] != ".":  # %-formatting: ~40% faster than an f-string
                        p = "%s%s/%s/%s" % (root, k[:dot], k[-1], k)  # noqa: UP031
                    else:
                        p = root + fmt.relpath(k)
                    out[i] = cache[k] = p
        return out  # type: ignore[return-value]

    def _pool(self) -> ThreadPoolExecutor | None:
        if self._closed:
            return None
        ex = self._executor
        if ex is None:
            with self._executor_lock:
                if self._executor is None and not self._closed:
                    self._executor = ThreadPoolExecutor(
                        self.options.io_threads - 1, thread_name_prefix="hicache-file"
                    )
                ex = self._executor
        return ex

    def _batch(
        self,
        op: IoOp,
        keys: Sequence[str],
        iovs: list[list[Any]],
        sizes: list[int],
        posts: list[Post | None] | None,
    ) -> list[bool]:
        paths = self._paths(keys)
        n = len(paths)
        threads = self.options.io_threads
        if op is IoOp.EXISTS:
            found = list(map(os.access, paths, repeat(os.F_OK)))
            self._absent.keys = {k for k, f in zip(keys, found) if not f}
            with self._stats_lock:
                self._stats.exists_checks += n
            return found
        parallel = (
            threads > 1 and n > 1 and not self._closed and sum(sizes) >= self.options.parallel_min_bytes
        )
        if op is not IoOp.GET:
            absent = getattr(self._absent, "keys", None) or frozenset()
            self._absent.keys = None
        work: Any = self._get_range if op is IoOp.GET else self._set_range
        args: tuple[Any, ...] = (keys, paths, iovs, sizes, posts if op is IoOp.GET else absent)
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
        gone = nbytes = 0
        for key, size in victims:
            try:
                os.unlink(self._prefix + fmt.relpath(key))
            except FileNotFoundError:
                continue  # evicted or cleared by another process already
            except OSError as err:  # the budget is best effort; never fail the batch for it
                log.warning("hicache.file: cannot evict %s: %s", key, err.strerror or err)
                continue
            gone += 1
            nbytes += size
        with self._stats_lock:
            self._stats.evictions += gone
            self._stats.evicted_bytes += nbytes
        log.debug("hicache.file: evicted %d pages (%d bytes) to fit max_bytes", gone, nbytes)

    # ------------------------------------------------------------ the I/O
    def _get_range(
        self,
        keys: Sequence[str],
        paths: list[str],
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
        spare = bytearray(1)  # a byte read into it means trailing garbage
        track = self.index is not None
        for j in range(lo, hi):
            key, path, iov, size = keys[j], paths[j], iovs[j], sizes[j]
            kb = key.encode("ascii")
            fixed, pad = parts(len(kb), size)  # the valid header: fixed (checksum aside) + kb + pad
            hsize = _FH + len(kb) + len(pad)
            try:
                fd = os.open(path, _RFLAGS)
            except FileNotFoundError:
                misses += 1
                out.append(False)
                continue
            except OSError as err:
                tally.error("read_errors", err, path)
                out.append(False)
                continue
            reason: str | None = "?"
            ident = None
            try:
                hdr = bytearray(hsize)
                nread = os.readv(fd, [hdr, *iov, spare])
                if (
                    nread == hsize + size
                    and hdr[:16] == fixed[:16]
                    and hdr[_FH:] == kb + pad
                    and int.from_bytes(hdr[16:24], "little")
                    == (xxh3(iov[0]) if len(iov) == 1 else checksum(iov))
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
                tally.error("read_errors", err, path)
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
                self._quarantine(path, ident, reason, tally)
                tally.gone.append(key)
        tally.add("hits", hits)
        tally.add("misses", misses)
        tally.add("bytes_read", nbytes)
        return out, tally

    def _quarantine(self, path: str, ident: tuple[int, int] | None, reason: str, tally: _Tally) -> None:
        """Count, log and delete a corrupt page (only if it is still the file we read)."""
        tally.add("integrity_errors")
        try:
            st = os.stat(path)
            if ident is None or (st.st_dev, st.st_ino) == ident:
                os.unlink(path)
                removed = "removed"
            else:
                removed = "kept (replaced meanwhile by a new page)"
        except OSError as err:
            removed = f"could not remove: {err.strerror or err}"
        log.warning("hicache.file: corrupt page %s (%s): read as a miss, %s", path, reason, removed)

    def _set_range(
        self,
        keys: Sequence[str],
        paths: list[str],
        iovs: list[list[Any]],
        sizes: list[int],
        absent: frozenset[str] | set[str],
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
        fsync_dirs: dict[str, list[int]] = {}
        for j in range(lo, hi):
            key, path, iov, size = keys[j], paths[j], iovs[j], sizes[j]
            kb = key.encode("ascii")
            disk = fmt.header_size(len(kb)) + size
            # Skip present keys; a key this thread's last exists() found absent needs no second
            # look (if another process wrote it since, publish() keeps that copy or replaces
            # it with identical bytes: both fine).
            if key not in absent and access(path, f_ok):
                skipped += 1
                if track:
                    tally.touched.append((key, disk))
                out.append(True)
                continue
            if budget is not None and disk > budget:
                tally.error("write_errors", OSError(errno.EFBIG, f"page exceeds max_bytes={budget}"), path)
                out.append(False)
                continue
            d = path[: len(path) - len(key)]
            try:
                digest = xxh3(iov[0]) if len(iov) == 1 else checksum(iov)
                fresh = publish(d, path, [header(kb, size, digest), *iov], disk)
            except OSError as err:
                tally.error("write_errors", err, path)
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
                fsync_dirs.setdefault(d, []).append(len(out))
            out.append(True)
        for d, positions in fsync_dirs.items():
            try:
                fsync_dir(d)
            except OSError as err:
                tally.error("write_errors", err, d)
                for p in positions:
                    out[p] = False
        tally.add("writes", writes)
        tally.add("skipped_writes", skipped)
        tally.add("bytes_written", nbytes)
        return out, tally
