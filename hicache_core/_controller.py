"""``CacheController``: moves pages between host pools and the selected storage backend.

It attaches a store (registers every pool through ``hicache_register_pool``), picks the I/O
path once (v2 when declared and the layout allows it, else v1), resolves draft offload from
the declared ``hicache_draft_io_capability`` (never from a backend name), and runs ``backup``,
``query`` and ``prefetch`` synchronously or on a thread pool.
"""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, TypeVar

from . import _one_batch
from ._batch import NATIVE
from ._config import StorageConfig
from ._errors import BackendTimeoutError, BatchShapeError, ConfigError, HiCacheError, PoolError
from ._keys import ValidHashes
from ._plan import (
    IndexLike,
    Plan,
    assign,
    check_count,
    chunks,
    mark,
    new_flags,
    plan_request,
    restorable,
    usable,
)
from ._pool_group import HostPoolGroup
from ._pools import HostPool
from ._prefetch import PrefetchHandle
from ._results import QueryResult, TransferResult
from ._store import Store
from ._types import DraftIo, DraftIoMode, HitPolicy, IoOp, Layout, PoolName, PoolTransfer

__all__ = ["CacheController", "DraftOffloadDisabledWarning", "PrefetchHandle"]

log = logging.getLogger("hicache")
T = TypeVar("T")


class DraftOffloadDisabledWarning(UserWarning):
    """Draft KV offload was disabled for this store (the message says why)."""


class _Op:
    """One operation's scratch state, passed down explicitly (operations may run concurrently).

    ``hashes``: the request's validated page hashes; ``errors``: backend failures met so far;
    ``keycache``: per pool, the keys resolved so far (see ``CacheController._keys_for``).
    """

    __slots__ = ("errors", "hashes", "keycache")

    def __init__(self, hashes: ValidHashes) -> None:
        self.hashes = hashes
        self.errors: list[str] = []
        self.keycache: dict[PoolName, Any] = {}


class CacheController:
    """Attach ``pools`` to the store named by ``config`` and move pages.

    ``pools`` may be planned (``allocate=False``): the controller then allocates them in one
    region from the store (``hicache_alloc_host_memory``). Pass ``store=`` to share an open
    store; otherwise the controller opens (and on :meth:`close` closes) its own.
    """

    def __init__(
        self, config: StorageConfig, pools: HostPoolGroup | HostPool, *, store: Store | None = None
    ) -> None:
        self.config = config
        self.settings = config.controller
        self.pools = pools if isinstance(pools, HostPoolGroup) else HostPoolGroup(pools)
        self._owns_store = store is None
        self.store = store if store is not None else Store(config)
        try:
            self._attach()
        except BaseException:
            if self._owns_store:
                self.store.close()
            raise
        self._executor = ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix="hicache-io")
        # Backend calls run here only when io_timeout_s is set; abandoned (stuck) calls keep a
        # thread each, so the pool is larger than the number of concurrent operations.
        self._call_pool = ThreadPoolExecutor(
            4 * self.settings.io_threads + 4, thread_name_prefix="hicache-call"
        )
        self._closed = False

    # ----------------------------------------------------------------- attach
    def _attach(self) -> None:
        store, caps, cfg = self.store, self.store.capabilities, self.config
        anchor = self.pools.anchor
        if anchor.rank_replicated != cfg.is_mla_model:
            raise ConfigError(
                f"config.is_mla_model={cfg.is_mla_model} but the KV pool is a {type(anchor).__name__}; "
                "set is_mla_model=True exactly when the KV pool is rank-replicated (MLAKVPool)"
            )
        for name, pool in self.pools.items():
            if pool.layout is not cfg.layout:
                raise PoolError(
                    f"pool {name.value!r} uses layout {pool.layout.value!r} but config.layout is "
                    f"{cfg.layout.value!r}; build every pool with the configured layout"
                )
        if not self.pools.allocated:
            self.pools.allocate(store.alloc_host_memory)
        self.io_path = "v2" if caps.v2 and (cfg.layout is Layout.PAGE_FIRST or not caps.zero_copy) else "v1"
        if self.io_path == "v1" and not caps.v1:
            raise PoolError(
                f"backend {store.name!r} only implements zero-copy v2, which needs layout='page_first'; "
                f"config.layout is {cfg.layout.value!r}"
            )
        self.draft_io, self._draft_path = self._resolve_draft()
        for name, pool in self.pools.items():
            if name is PoolName.DRAFT and self._draft_path is None:
                continue
            store.register_pool(name, pool)
        self._io: Callable[[_Op, IoOp, list[Plan]], list[list[bool]]] = (
            self._io_v2 if self.io_path == "v2" else self._io_v1
        )
        self._draft_io_fn = {"v2": self._io_v2, "v1": self._io_v1, None: None}[self._draft_path]
        # Backup sends pages without an existence pass when SET itself keeps stored objects.
        self._set_skips_existing = caps.set_skips_existing
        # Requests that may take the one-batch path (module ``_one_batch``): the KV pool alone on
        # v2, without draft offload or a call timeout. Backups (``_one_batch_backup``) also need
        # this rank to write the pages; prefetches (``_one_batch``) a threshold of at most one page.
        one_batch = (
            len(self.pools) == 1
            and self.io_path == "v2"
            and self._draft_path is None
            and self.settings.io_timeout_s is None
        )
        self._one_batch_backup = one_batch and (cfg.tp_rank == 0 or not anchor.rank_replicated)
        self._one_batch = one_batch and self.settings.prefetch_threshold <= 1
        self._kv_policy = HitPolicy(anchor.hit_policy)
        self._anchor = anchor
        self._batch_pages = self.settings.batch_pages  # settings are frozen

    def _resolve_draft(self) -> tuple[DraftIo, str | None]:
        if PoolName.DRAFT not in self.pools:
            return DraftIo(DraftIoMode.UNSUPPORTED, "no draft pool in this HostPoolGroup"), None
        store, caps = self.store, self.store.capabilities
        try:
            declared = store.draft_io()
        except HiCacheError as err:
            declared = DraftIo(DraftIoMode.UNSUPPORTED, f"hicache_draft_io_capability failed: {err}")
        reason = ""
        path: str | None = None
        if declared.mode is DraftIoMode.ZERO_COPY_V2:
            if self.config.should_split_heads:
                reason = "should_split_heads=True is incompatible with zero-copy v2 draft I/O"
            elif self.io_path != "v2" or PoolName.DRAFT not in caps.pools:
                reason = "zero-copy v2 draft I/O needs the v2 path with layout='page_first'"
            else:
                path = "v2"
        elif declared.mode is DraftIoMode.GENERIC:
            if caps.v1 and PoolName.DRAFT in caps.pools:
                path = "v1"
            else:
                reason = "generic draft I/O needs the v1 path and the 'draft' pool"
        else:
            reason = declared.reason or "the backend declares draft I/O unsupported"
            if self.config.should_split_heads and caps.draft_io is DraftIoMode.ZERO_COPY_V2:
                reason = f"should_split_heads=True disables zero-copy v2 draft I/O ({reason})"
        if path is None:
            msg = f"hicache: draft KV offload disabled for backend {store.name!r}: {reason}"
            log.warning(msg)
            warnings.warn(msg, DraftOffloadDisabledWarning, stacklevel=4)
            return DraftIo(DraftIoMode.UNSUPPORTED, reason), None
        return declared, path

    @property
    def draft_enabled(self) -> bool:
        return self._draft_path is not None

    # --------------------------------------------------------------- planning
    def _plans(
        self, n: int, host_indices: IndexLike, extra: Mapping[PoolName | str, IndexLike] | None
    ) -> tuple[list[Plan], Plan | None]:
        return plan_request(self.pools, n, host_indices, extra, self._draft_path is not None)

    def _kv_indices(self, host_indices: IndexLike, n: int) -> list[int]:
        idx = self.pools.anchor.check_indices(host_indices)
        check_count(idx, n)
        return idx

    def _one_batch_args(
        self, page_hashes: Sequence[str], host_indices: IndexLike
    ) -> tuple[ValidHashes, tuple[int, ...]] | None:
        """The checked hashes and KV host indices (a tuple, as a ``PoolTransfer`` holds them) of
        a request that fits one batch; ``None`` for the general path. Bad input raises."""
        kind = type(page_hashes)
        listed = tuple(page_hashes) if kind is list or kind is tuple else self._check_hashes(page_hashes)
        n = len(listed)
        if not 0 < n <= self._batch_pages:
            return None
        idx = NATIVE.index_tuple(host_indices, self._anchor.num_pages) if NATIVE is not None else None
        if idx is None or len(idx) != n:  # anything but a list / tuple of valid ints (errors too)
            idx = self._anchor._index_tuple(host_indices)
            if len(idx) != n:
                check_count(list(idx), n)  # raises
        return ValidHashes(listed), idx

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return chunks(n, self.settings.batch_pages)

    # --------------------------------------------------------------- raw I/O
    def _io_v2(self, ctx: _Op, op: IoOp, plans: list[Plan]) -> list[list[bool]]:
        transfers = []
        all_hashes = ctx.hashes
        for p in plans:
            pos = p.positions
            hashes = all_hashes if len(pos) == len(all_hashes) else all_hashes.pick(pos)
            keys = self._keys_for(ctx, p) if hashes else []
            policy = p.pool.hit_policy
            if type(policy) is not HitPolicy:
                policy = HitPolicy(policy)
            # Every field is final: a PoolName, ints from check_indices, valid hashes, key tuples.
            transfers.append(PoolTransfer._trusted(p.name, tuple(p.indices), hashes, policy, tuple(keys)))
        return self._guard(
            ctx, op, lambda: self.store.batch_io_v2(op, transfers), [len(p.positions) for p in plans]
        )

    def _io_v1(self, ctx: _Op, op: IoOp, plans: list[Plan]) -> list[list[bool]]:
        keys: list[str] = []
        views: list[Any] = []
        ncomp = []
        for p in plans:
            page_keys = self._keys_for(ctx, p) if p.positions else []
            ncomp.append(len(p.pool.components))
            keys.extend(itertools.chain.from_iterable(page_keys))
            if op is not IoOp.EXISTS:
                views.extend(itertools.chain.from_iterable(p.pool.page_views(p.indices)))
        sizes = [len(p.positions) * c for p, c in zip(plans, ncomp)]
        flat = self._guard(
            ctx,
            op,
            lambda: [self.store.batch_io_v1(op, keys, None if op is IoOp.EXISTS else views)],
            [len(keys)],
        )[0]
        out, off = [], 0
        for size, c in zip(sizes, ncomp):
            part = flat[off : off + size]
            off += size
            if c == 1:
                out.append(part)
            elif all(part):  # the usual outcomes: every component done, or none
                out.append([True] * (size // c))
            elif not any(part):
                out.append([False] * (size // c))
            else:  # a page is done when all its components are
                out.append([all(t) for t in zip(*[part[k::c] for k in range(c)])])
        return out

    def _bounded(self, call: Callable[[], T]) -> T:
        timeout = self.settings.io_timeout_s
        if timeout is None:
            return call()
        future = self._call_pool.submit(call)
        try:
            return future.result(timeout=timeout)
        except FuturesTimeout:
            raise BackendTimeoutError(
                f"no answer within io_timeout_s={timeout}s; the call was abandoned and its pages are "
                "reported failed (raise io_timeout_s if the backend is just slow)"
            ) from None

    def _guard(
        self, ctx: _Op, op: IoOp, call: Callable[[], list[list[bool]]], sizes: list[int]
    ) -> list[list[bool]]:
        try:
            return call() if self.settings.io_timeout_s is None else self._bounded(call)
        except Exception as err:
            self._failed(ctx.errors, op, err, sum(sizes))
            return [[False] * s for s in sizes]

    def _failed(self, errors: list[str], op: IoOp, err: Exception, n: int) -> list[bool]:
        """Log and record a failed backend call of ``n`` entries; they all count as failed."""
        msg = f"backend {self.store.name!r} failed {op.value} of {n} entries: {type(err).__name__}: {err}"
        log.error("hicache: %s", msg, exc_info=not isinstance(err, HiCacheError))
        errors.append(msg)
        return [False] * n

    # ------------------------------------------------------------- operations
    def backup(
        self,
        page_hashes: Sequence[str],
        host_indices: IndexLike,
        extra: Mapping[PoolName | str, IndexLike] | None = None,
    ) -> TransferResult:
        """Write pages host -> storage, skipping pages already stored; every pool of a page goes with it.

        ``host_indices[i]`` holds page ``page_hashes[i]`` in the KV pool. ``extra`` gives other
        pools' host indices: all-pages sidecars (indexer, draft) default to the KV indices;
        trailing-state pools (Mamba) are written only when given, aligned with the LAST pages.
        """
        if self._one_batch_backup and not extra:
            args = self._one_batch_args(page_hashes, host_indices)
            if args is not None:
                return _one_batch.backup(
                    self.store, *args, self._kv_policy, self._set_skips_existing, self._failed
                )
        return self._prepare("backup", page_hashes, host_indices, extra)()

    def backup_async(
        self, page_hashes: Sequence[str], host_indices: IndexLike, extra: Any = None
    ) -> Future[TransferResult]:
        return self._submit(self._prepare("backup", page_hashes, host_indices, extra))

    def query(self, page_hashes: Sequence[str], *, trailing_window: int = 1) -> QueryResult:
        """How many leading pages can be restored: the minimum over pools under their hit policies."""
        return self._prepare_query(page_hashes, trailing_window)()

    def query_async(self, page_hashes: Sequence[str], *, trailing_window: int = 1) -> Future[QueryResult]:
        return self._submit(self._prepare_query(page_hashes, trailing_window))

    def prefetch(
        self,
        page_hashes: Sequence[str],
        host_indices: IndexLike,
        extra: Mapping[PoolName | str, IndexLike] | None = None,
    ) -> TransferResult:
        """Read the restorable prefix storage -> host. ``result.pages`` pages are usable.

        Trailing-state pools (Mamba) given in ``extra`` receive the state of the last restored
        pages. Draft pages are read before the target pages; a draft failure never lowers
        ``result.pages``.
        """
        if self._one_batch and not extra:
            args = self._one_batch_args(page_hashes, host_indices)
            if args is not None:
                return _one_batch.prefetch(self.store, *args, self._kv_policy, self._failed)
        return self._prepare("prefetch", page_hashes, host_indices, extra)()

    def prefetch_async(
        self, page_hashes: Sequence[str], host_indices: IndexLike, extra: Any = None
    ) -> PrefetchHandle:
        stop = threading.Event()
        run = self._prepare("prefetch", page_hashes, host_indices, extra, stop)
        return PrefetchHandle(
            self._submit(run), stop, self.settings.prefetch_policy, self.settings.prefetch_timeout_s
        )

    # ------------------------------------------------------------ internals
    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._closed:
            raise HiCacheError("CacheController is closed")
        return self._executor.submit(fn)

    def _check_hashes(self, page_hashes: Sequence[str]) -> tuple[str, ...]:
        if isinstance(page_hashes, (str, bytes)):
            raise BatchShapeError("page_hashes must be a sequence of hash strings, not a single string")
        try:
            return tuple(page_hashes)
        except TypeError:
            raise BatchShapeError(
                f"page_hashes must be a sequence of hash strings, got {type(page_hashes).__name__}"
            ) from None

    def _prepare(
        self,
        kind: str,
        page_hashes: Sequence[str],
        host_indices: IndexLike,
        extra: Any,
        stop: threading.Event | None = None,
    ) -> Callable[[], TransferResult]:
        listed = self._check_hashes(page_hashes)
        plans, draft = self._plans(len(listed), host_indices, extra)
        ctx = _Op(ValidHashes(listed))  # checked once: the key hook trusts a ValidHashes
        if kind == "backup":
            return lambda: self._run_backup(ctx, plans, draft)
        return lambda: self._run_prefetch(ctx, plans, draft, stop)

    def _prepare_query(self, page_hashes: Sequence[str], window: int) -> Callable[[], QueryResult]:
        listed = self._check_hashes(page_hashes)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise BatchShapeError(f"trailing_window must be >= 1, got {window}")
        ctx = _Op(ValidHashes(listed))
        return lambda: self._run_query(ctx, window)

    def _keys_for(self, ctx: _Op, p: Plan) -> Sequence[tuple[str, ...]]:
        """Keys of ``p``'s pages, resolved through the hook once per page per operation.

        Per pool, ``keycache`` holds a tuple of every position's keys once all are resolved,
        else a list with ``None`` for positions not resolved yet. Each entry is made a tuple
        once, so transfers take the keys as they are.
        """
        hashes, pos = ctx.hashes, p.positions
        n = len(hashes)
        caches = ctx.keycache
        cache = caches.get(p.name)
        if cache is None:
            if len(pos) == n:  # the whole request at once (positions ascend: they are 0..n-1)
                keys = caches[p.name] = tuple(map(tuple, self.store.page_keys(p.name, hashes)))
                return keys
            cache = caches[p.name] = [None] * n
        elif type(cache) is tuple:
            return cache if len(pos) == n else list(map(cache.__getitem__, pos))
        todo = [i for i in pos if cache[i] is None]
        if todo:
            resolved = self.store.page_keys(p.name, hashes if len(todo) == n else hashes.pick(todo))
            for i, k in zip(todo, resolved):
                cache[i] = tuple(k)
        return cache if len(pos) == n else list(map(cache.__getitem__, pos))

    def _run_backup(self, ctx: _Op, plans: list[Plan], draft: Plan | None) -> TransferResult:
        n = len(ctx.hashes)
        flags, base = new_flags(plans)
        skipped = 0
        owner = self.config.tp_rank == 0
        for start, stop in self._chunks(n):
            chunk = [p.window(start, stop) for p in plans]
            writable = [c for c in chunk if c.positions and (owner or not c.pool.rank_replicated)]
            for c in chunk:
                if c not in writable:  # rank-replicated data: rank 0 writes it
                    mark(flags[c.name], base[c.name], c.positions, [True] * len(c.positions))
                    skipped += len(c.positions)
            if not writable:
                continue
            if self._set_skips_existing:  # the backend skips stored pages itself: no round trip
                missing = writable
            else:
                missing = []
                for c, ex in zip(writable, self._io(ctx, IoOp.EXISTS, writable)):
                    mark(flags[c.name], base[c.name], c.positions, ex)
                    skipped += sum(ex)
                    todo = c.missing(ex)
                    if todo is not None:
                        missing.append(todo)
            if missing:
                for c, ok in zip(missing, self._io(ctx, IoOp.SET, missing)):
                    mark(flags[c.name], base[c.name], c.positions, ok)
        draft_flags = self._draft_op(ctx, IoOp.SET, draft) if draft is not None else None
        return TransferResult(
            pages=usable(plans, flags, n),
            per_pool=flags,
            draft=draft_flags,
            skipped=skipped,
            errors=tuple(ctx.errors),
        )

    def _draft_op(self, ctx: _Op, op: IoOp, draft: Plan) -> list[bool]:
        """Draft I/O in its own calls, so a draft failure never touches the target pages."""
        assert self._draft_io_fn is not None
        saved = list(ctx.errors)
        out = [False] * len(draft.positions)
        base = draft.positions[0] if draft.positions else 0
        try:
            for start, stop in self._chunks(len(ctx.hashes)):
                part = draft.window(start, stop)
                if not part.positions:
                    continue
                if op is IoOp.SET and not self._set_skips_existing:
                    ex = self._draft_io_fn(ctx, IoOp.EXISTS, [part])[0]
                    todo = [i for i, e in enumerate(ex) if not e]
                    for i, e in enumerate(ex):
                        out[part.positions[i] - base] = e
                    if not todo:
                        continue
                    part = Plan(
                        part.name,
                        part.pool,
                        [part.positions[i] for i in todo],
                        [part.indices[i] for i in todo],
                    )
                for pos, ok in zip(part.positions, self._draft_io_fn(ctx, op, [part])[0]):
                    out[pos - base] = ok
        except Exception as err:  # never let draft break the target path
            log.error("hicache: draft %s failed on backend %r: %s", op.value, self.store.name, err)
        draft_errors = ctx.errors[len(saved) :]
        del ctx.errors[len(saved) :]
        for message in draft_errors:
            log.warning("hicache: draft offload error (target pages unaffected): %s", message)
        return out

    def _exists_all(self, ctx: _Op, plans: list[Plan]) -> dict[PoolName, list[bool]]:
        """Existence of every page of every plan, stopping after the chunk where the KV prefix ends."""
        n = len(ctx.hashes)
        found = {p.name: [False] * n for p in plans}
        for start, stop in self._chunks(n):
            chunk = [p.window(start, stop) for p in plans]
            res = self._io(ctx, IoOp.EXISTS, chunk)
            done = False
            for c, ex in zip(chunk, res):
                assign(found[c.name], c.positions, ex)
                if c.pool.hit_policy is HitPolicy.ALL_PAGES and not all(ex):
                    done = True
            if done:
                break
        return found

    def _run_query(self, ctx: _Op, window: int) -> QueryResult:
        n = len(ctx.hashes)
        plans = [
            Plan(name, pool, list(range(n)), [0] * n)
            for name, pool in self.pools.items()
            if name is not PoolName.DRAFT
        ]
        if n == 0:
            return QueryResult(0, {p.name: 0 for p in plans})
        pages, per_pool = restorable(plans, self._exists_all(ctx, plans), window)
        return QueryResult(pages, per_pool, tuple(ctx.errors))

    def _run_prefetch(
        self, ctx: _Op, plans: list[Plan], draft: Plan | None, stop: threading.Event | None
    ) -> TransferResult:
        n = len(ctx.hashes)
        windows = [len(p.positions) for p in plans if p.pool.hit_policy is HitPolicy.TRAILING_PAGES]
        if not windows and self.settings.prefetch_threshold <= 1:
            return self._prefetch_direct(ctx, plans, draft, stop)
        probe = [Plan(p.name, p.pool, list(range(n)), [0] * n) for p in plans]
        found = self._exists_all(ctx, probe) if n else {p.name: [] for p in plans}
        pages, _ = restorable(probe, found, max(windows, default=1)) if n else (0, {})
        empty: dict[PoolName, list[bool]] = {p.name: [] for p in plans}
        if pages < max(1, self.settings.prefetch_threshold) or pages == 0:
            return TransferResult(0, empty, [] if draft is not None else None, 0, tuple(ctx.errors))
        # Re-aim every plan at the restorable prefix [0, pages).
        target: list[Plan] = []
        for p in plans:
            if p.pool.hit_policy is HitPolicy.TRAILING_PAGES:
                k = min(len(p.indices), pages)
                target.append(
                    Plan(p.name, p.pool, list(range(pages - k, pages)), p.indices[len(p.indices) - k :])
                )
            else:
                target.append(p.window(0, pages))
        draft_flags = None
        if draft is not None:
            draft_flags = self._draft_op(ctx, IoOp.GET, draft.window(0, pages))
        flags, base = new_flags(target)
        for start, end in self._chunks(pages):
            if stop is not None and stop.is_set():
                break
            chunk = [c for p in target if (c := p.window(start, end)).positions]
            for c, ok in zip(chunk, self._io(ctx, IoOp.GET, chunk)):
                mark(flags[c.name], base[c.name], c.positions, ok)
        return TransferResult(
            pages=usable(target, flags, pages),
            per_pool=flags,
            draft=draft_flags,
            errors=tuple(ctx.errors),
        )

    def _prefetch_direct(
        self, ctx: _Op, plans: list[Plan], draft: Plan | None, stop: threading.Event | None
    ) -> TransferResult:
        """Prefetch without an existence pass: GET batch by batch, stop after the first miss.

        Only for requests without trailing-state pools: a GET that fails is a miss, and the
        leading run of fully read pages is the usable prefix. At most one batch past the end of
        the prefix is read in vain; the existence round trip is saved on every batch.
        """
        n = len(ctx.hashes)
        flags, base = new_flags(plans)
        draft_flags: list[bool] | None = [] if draft is not None else None
        for start, end in self._chunks(n):
            if stop is not None and stop.is_set():
                break
            if draft is not None and draft_flags is not None:
                draft_flags += self._draft_op(ctx, IoOp.GET, draft.window(start, end))  # draft first
            chunk = [c for p in plans if (c := p.window(start, end)).positions]
            complete = True
            for c, ok in zip(chunk, self._io(ctx, IoOp.GET, chunk)):
                mark(flags[c.name], base[c.name], c.positions, ok)
                complete = complete and all(ok)
            if not complete:
                break
        pages = usable(plans, flags, n)
        if draft is not None and draft_flags is not None:
            draft_flags += [False] * (len(draft.positions) - len(draft_flags))  # batches not reached
        return TransferResult(pages=pages, per_pool=flags, draft=draft_flags, errors=tuple(ctx.errors))

    # ----------------------------------------------------------------- admin
    def clear(self) -> int:
        """Remove this config's namespace from storage (other models and dtypes are untouched)."""
        return self.store.clear()

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self._call_pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
