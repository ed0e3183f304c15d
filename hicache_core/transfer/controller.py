"""``CacheController``: moves pages between host pools and the selected storage backend.

It attaches a store (registers every pool through ``hicache_register_pool``), picks the I/O
path once (v2 when declared and the layout allows it, else v1), resolves draft offload from
the declared ``hicache_draft_io_capability`` (never from a backend name), and runs ``backup``,
``query`` and ``prefetch`` synchronously or on a thread pool.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import torch

from ..config import PrefetchPolicy, StorageConfig
from ..errors import (
    ArgumentTypeError,
    BatchShapeError,
    BatchTypeError,
    ClosedError,
    ConfigError,
    HiCacheError,
    PoolError,
)
from ..plugin import Store
from ..pools import HostPool, HostPoolGroup
from ..types import DraftIo, DraftIoMode, HitPolicy, IoOp, PoolName
from .calls import CallPool
from .path import IoPath, Ownership, Request, TransferPath, select_io_path
from .plan import IndexLike, Plan, Planner, leading_run, restorable, usable
from .prefetch import PrefetchHandle
from .results import QueryResult, TransferResult

__all__ = ["CacheController", "DraftOffloadDisabledWarning", "PrefetchHandle"]

log = logging.getLogger("hicache")
T = TypeVar("T")
_TRAILING = HitPolicy.TRAILING_PAGES  # an enum member lookup costs a Python call (Python 3.11)


class DraftOffloadDisabledWarning(UserWarning):
    """Draft KV offload was disabled for this store (the message says why)."""


class CacheController:
    """Attach ``pools`` to the store named by ``config`` and move pages.

    ``pools`` may be planned (``allocate=False``): the controller then allocates them in one
    region from the store (``hicache_alloc_host_memory``). Pass ``store=`` to share an open
    store; otherwise the controller opens (and on :meth:`close` closes) its own.
    """

    def __init__(
        self, config: StorageConfig, pools: HostPoolGroup | HostPool, *, store: Store | None = None
    ) -> None:
        if not isinstance(config, StorageConfig):
            raise ArgumentTypeError(
                f"config must be a hicache_core.StorageConfig, got {type(config).__name__}"
            )
        if store is not None and not isinstance(store, Store):
            raise ArgumentTypeError(f"store must be a hicache_core.Store or None, got {type(store).__name__}")
        self.pools = pools if isinstance(pools, HostPoolGroup) else HostPoolGroup(pools)
        self.config = config = _keyed_config(config, self.pools, store)
        self.settings = config.controller
        self._owns_store = store is None
        # Backend calls run here only when io_timeout_s is set; abandoned (stuck) calls keep a
        # thread each, so the pool is larger than the number of concurrent operations. Threads
        # start on first use.
        self._call_pool = CallPool(4 * self.settings.io_threads + 4)
        if store is not None:
            _check_same_store_config(config, store)
        self.store = store if store is not None else Store(config)
        try:
            self._attach()
        except BaseException:
            if self._owns_store:
                self.store.close()
            raise
        self._executor = ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix="hicache-io")
        self._running: set[object] = set()  # operations started (sync or queued), not finished
        self._running_changed = threading.Condition()
        self._closed = False
        _ATTACHED.setdefault(self.store, weakref.WeakSet()).add(self)

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
        io_path = select_io_path(caps, cfg.layout)
        if io_path is None:
            raise PoolError(
                f"backend {store.name!r} only implements zero-copy v2, which needs layout='page_first'; "
                f"config.layout is {cfg.layout.value!r}"
            )
        # A call that may be abandoned (io_timeout_s, or the deadline of the timeout policy) must
        # never touch host memory afterwards: such a store moves pages through staging buffers,
        # which only the v1 path can take.
        self.staged = (
            self.settings.io_timeout_s is not None or self.settings.prefetch_policy is PrefetchPolicy.TIMEOUT
        )
        if self.staged:
            if not caps.v1:
                raise ConfigError(
                    f"backend {store.name!r} implements only v2, which moves pages straight from and to "
                    "host memory, so a call abandoned by io_timeout_s or the 'timeout' prefetch policy "
                    "could still write host slots later; leave io_timeout_s unset and use the "
                    "'best_effort' or 'wait_complete' prefetch policy with this backend"
                )
            io_path = "v1"
        self.io_path: IoPath = io_path
        self.draft_io, draft_path = self._resolve_draft()
        for name, pool in self.pools.items():
            if name is PoolName.DRAFT and draft_path is None:
                continue
            held = store.pools.get(name)
            if held is not None and held is not pool and _in_use(store, name, held):
                # The backend keeps one pool per name (zero-copy I/O addresses its memory), so a
                # second pool under that name would make the open controller move this memory.
                raise PoolError(
                    f"store {store.name!r} already has a different {name.value!r} pool registered "
                    "(by another CacheController sharing it); a shared store serves one pool group: "
                    "share the controller, or open a store per pool group"
                )
            store.register_pool(name, pool)
        self.path = self._transfer_path(self.io_path)
        self.draft_path = self._transfer_path(draft_path) if draft_path is not None else None
        self._planner = Planner(self.pools)

    def _transfer_path(self, io_path: IoPath) -> TransferPath:
        settings = self.settings
        return TransferPath(
            self.store,
            io_path,
            batch_pages=settings.batch_pages,
            owner=self.config.tp_rank == 0,
            io_timeout_s=settings.io_timeout_s,
            call_pool=self._call_pool,
            staged=self.staged,
        )

    def _resolve_draft(self) -> tuple[DraftIo, IoPath | None]:
        if PoolName.DRAFT not in self.pools:
            return DraftIo(DraftIoMode.UNSUPPORTED, "no draft pool in this HostPoolGroup"), None
        store, caps = self.store, self.store.capabilities
        try:
            declared = store.draft_io()
        except HiCacheError as err:
            declared = DraftIo(DraftIoMode.UNSUPPORTED, f"hicache_draft_io_capability failed: {err}")
        reason = ""
        path: IoPath | None = None
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
        return self.draft_path is not None

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
        req, plans, draft = self._prepare(page_hashes, host_indices, extra, self._sync_owner())
        token = self._start(req)
        try:
            return self._run_backup(req, plans, draft)
        finally:
            self._finish(token)

    def backup_async(
        self, page_hashes: Sequence[str], host_indices: IndexLike, extra: Any = None
    ) -> Future[TransferResult]:
        req, plans, draft = self._prepare(page_hashes, host_indices, extra, Ownership())
        return self._submit(partial(self._run_backup, req, plans, draft), req)

    def query(self, page_hashes: Sequence[str], *, trailing_window: int = 1) -> QueryResult:
        """How many leading pages can be restored: the minimum over pools under their hit policies."""
        req = self._prepare_query(page_hashes, trailing_window, self._sync_owner())
        token = self._start(req)
        try:
            return self._run_query(req, trailing_window)
        finally:
            self._finish(token)

    def query_async(self, page_hashes: Sequence[str], *, trailing_window: int = 1) -> Future[QueryResult]:
        req = self._prepare_query(page_hashes, trailing_window, Ownership())
        return self._submit(partial(self._run_query, req, trailing_window), req)

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
        req, plans, draft = self._prepare(page_hashes, host_indices, extra, self._sync_owner(), load=True)
        token = self._start(req)
        try:
            return self._run_prefetch(req, plans, draft, None, None)
        finally:
            self._finish(token)

    def prefetch_async(
        self, page_hashes: Sequence[str], host_indices: IndexLike, extra: Any = None
    ) -> PrefetchHandle:
        stop = threading.Event()
        progress = _Progress()
        owner = Ownership()
        req, plans, draft = self._prepare(page_hashes, host_indices, extra, owner, load=True)

        def abandon() -> TransferResult:
            owner.abandon()  # from here on, nothing of this prefetch touches the slots
            return progress.result(req)

        return PrefetchHandle(
            self._submit(partial(self._run_prefetch, req, plans, draft, stop, progress), req),
            stop,
            self.settings.prefetch_policy,
            self.settings.prefetch_timeout_s,
            abandon if self.staged else None,
        )

    # ------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this CacheController is closed; create a new one to move pages again")

    def _sync_owner(self) -> Ownership | None:
        """A synchronous operation's :class:`Ownership`: only a staged store's can be abandoned."""
        return Ownership() if self.staged else None

    def _start(self, req: Request) -> object:
        """Count an operation as running until :meth:`_finish` (``close`` waits for it, or on a
        staged store abandons its ``Ownership``); returns the token to finish it with."""
        token: object = req if req.owner is None else req.owner
        with self._running_changed:
            self._check_open()
            self._running.add(token)
        return token

    def _finish(self, token: object) -> None:
        with self._running_changed:
            self._running.discard(token)
            if self._closed:  # close() may be waiting for it
                self._running_changed.notify_all()

    def _submit(self, fn: Callable[[], T], req: Request) -> Future[T]:
        assert req.owner is not None  # every asynchronous operation has one, for close() to abandon
        token = self._start(req)
        try:
            future = self._executor.submit(fn)
        except BaseException:
            self._finish(token)
            raise
        # Runs when fn ends and also when the future is cancelled before it started.
        future.add_done_callback(lambda _: self._finish(token))
        return future

    def _prepare(
        self,
        page_hashes: Sequence[str],
        host_indices: IndexLike,
        extra: Any,
        owner: Ownership | None,
        load: bool = False,
    ) -> tuple[Request, list[Plan], Plan | None]:
        """Check a backup's or prefetch's arguments now (bad input raises here, not in a worker).

        ``owner``: the operation's :class:`Ownership` (``close`` waits for the operation, and on a
        staged store may abandon it)."""
        self._check_open()
        req = Request(page_hashes, owner) if type(page_hashes) is list else _request(page_hashes, owner)
        plans, draft = self._planner.plan(
            len(req.hashes), host_indices, extra, self.draft_path is not None, load
        )
        return req, plans, draft

    def _prepare_query(self, page_hashes: Sequence[str], window: int, owner: Ownership | None) -> Request:
        self._check_open()
        req = _request(page_hashes, owner)
        if type(window) is not int:
            raise BatchTypeError(f"trailing_window must be an int >= 1, got {window!r:.80}")
        if window < 1:
            raise BatchShapeError(f"trailing_window must be an int >= 1, got {window!r}")
        return req

    def _run_backup(self, req: Request, plans: list[Plan], draft: Plan | None) -> TransferResult:
        flags, skipped = self.path.put(req, plans)
        draft_flags = self._draft_op(req, IoOp.SET, draft) if draft is not None else None
        return TransferResult(
            pages=usable(plans, flags, len(req.hashes)),
            per_pool=flags,
            draft=draft_flags,
            skipped=skipped,
            errors=tuple(req.errors),
        )

    def _draft_op(self, req: Request, op: IoOp, draft: Plan) -> list[bool]:
        """Draft I/O on its own path and calls: a draft failure never touches the target pages."""
        assert self.draft_path is not None
        draft_req = Request(req.hashes, req.owner)
        try:
            if op is IoOp.SET:
                out = self.draft_path.put(draft_req, [draft])[0][PoolName.DRAFT]
            else:
                out = self.draft_path.get(draft_req, [draft], until_miss=False)[PoolName.DRAFT]
        except Exception as err:  # never let draft break the target path
            log.error("hicache: draft %s failed on backend %r: %s", op.value, self.store.name, err)
            out = [False] * len(draft.positions)
        for message in draft_req.errors:
            log.warning("hicache: draft offload error (target pages unaffected): %s", message)
        return out

    def _run_query(self, req: Request, window: int) -> QueryResult:
        n = len(req.hashes)
        plans = [_whole(name, pool, n) for name, pool in self.pools.items() if name is not PoolName.DRAFT]
        if n == 0:
            return QueryResult(0, {p.name: 0 for p in plans})
        pages, per_pool = restorable(plans, self.path.exists(req, plans), window)
        return QueryResult(pages, per_pool, tuple(req.errors))

    def _run_prefetch(
        self,
        req: Request,
        plans: list[Plan],
        draft: Plan | None,
        stop: threading.Event | None,
        progress: _Progress | None,
    ) -> TransferResult:
        n = len(req.hashes)
        stopped = stop.is_set if stop is not None else None
        trailing = []
        for p in plans:
            if p.pool.hit_policy is _TRAILING:
                trailing.append(len(p.positions))
        if not trailing and draft is None and self.settings.prefetch_threshold <= 1:
            # No existence pass: GET batch by batch and stop after the first miss (at most one
            # batch past the end of the prefix is read in vain; a round trip per batch is saved).
            if progress is None:  # synchronous: nobody reads the progress
                flags = self.path.get(req, plans)
                return TransferResult(
                    usable(plans, flags, n, anchored=True), flags, None, 0, tuple(req.errors)
                )
            progress.start(plans, n)
            self.path.get(req, plans, stopped=stopped, flags=progress.flags)
            return progress.result(req, final=True)
        if progress is None:
            progress = _Progress()
        window = max(trailing, default=1)
        probe = [_whole(p.name, p.pool, n) for p in plans]
        found = self.path.exists(req, probe) if n else {}
        pages = restorable(probe, found, window)[0] if n else 0
        if pages == 0 or pages < self.settings.prefetch_threshold:
            empty: dict[PoolName, list[bool]] = {p.name: [] for p in plans}
            return TransferResult(0, empty, [] if draft is not None else None, 0, tuple(req.errors))
        if draft is not None:
            progress.draft = self._draft_op(req, IoOp.GET, draft.window(0, pages))
        target = [_prefix(p, pages) for p in plans]  # every plan re-aimed at the prefix [0, pages)
        progress.start(target, pages)
        self.path.get(req, target, stopped=stopped, flags=progress.flags)
        leading = min(
            (leading_run(progress.flags[p.name]) for p in target if p.pool.hit_policy is HitPolicy.ALL_PAGES),
            default=pages,
        )
        if trailing and leading < pages and not (stopped is not None and stopped()):
            # An all-pages pool stopped short: the trailing state just read belongs to a longer
            # prefix. Re-anchor at the longest prefix within the pages read that has its own state.
            cut = {
                name: f[:leading] + [False] * (n - leading) if _all_pages(probe, name) else f
                for name, f in found.items()
            }
            pages = restorable(probe, cut, window)[0]
            if pages == 0:
                return TransferResult(0, progress.flags, progress.draft, 0, tuple(req.errors))
            anchored = [_prefix(p, pages) for p in plans]
            ends = [p for p in anchored if p.pool.hit_policy is HitPolicy.TRAILING_PAGES]
            flags = {p.name: progress.flags[p.name][:pages] for p in anchored if p not in ends}
            flags.update(self.path.get(req, ends, until_miss=False))
            progress.start(anchored, pages, flags)
        return progress.result(req, final=True)

    # ----------------------------------------------------------------- admin
    def clear(self) -> int:
        """Remove this config's namespace from storage (other models and dtypes are untouched)."""
        self._check_open()
        return self.store.clear()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop taking operations, cancel queued ones, and close the store this controller opened.

        On a staged store (``io_timeout_s`` set, or the ``timeout`` prefetch policy) operations
        still running after ``timeout_s`` are abandoned, logged, and never touch host memory
        again. Otherwise close waits for them: they move pages straight to and from host memory.
        """
        if getattr(self, "_closed", True):
            return
        with self._running_changed:
            self._closed = True
        self._executor.shutdown(wait=not self.staged, cancel_futures=True)
        if not self.staged:  # synchronous operations in callers' threads
            with self._running_changed:
                self._running_changed.wait_for(lambda: not self._running)
        else:
            with self._running_changed:
                self._running_changed.wait_for(lambda: not self._running, timeout=timeout_s)
                abandoned = list(self._running)
            for owner in abandoned:
                if isinstance(owner, Ownership):
                    owner.abandon()
            if abandoned:
                log.warning(
                    "hicache: close() abandoned %d operation(s) still waiting on backend %r after %.1f s; "
                    "they no longer touch host memory",
                    len(abandoned),
                    self.store.name,
                    timeout_s,
                )
        self._call_pool.shutdown()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The open controllers attached to each store, to refuse a second pool under a name in use.
_ATTACHED: weakref.WeakKeyDictionary[Store, weakref.WeakSet[CacheController]] = weakref.WeakKeyDictionary()


def _in_use(store: Store, name: PoolName, pool: HostPool) -> bool:
    return any(not c._closed and c.pools.get(name) is pool for c in _ATTACHED.get(store, ()))


def _keyed_config(config: StorageConfig, pools: HostPoolGroup, store: Store | None) -> StorageConfig:
    """``config``, with a ``kv_dtype`` it leaves unset taken from the dtype the KV pool holds.

    Pages of a float16 and a bfloat16 pool have the same size, so two controllers whose configs
    both left ``kv_dtype`` at its default would read each other's bytes as their own. A value the
    config sets is the operator's label (``"fp8_e4m3"`` over a ``uint8`` pool) and is kept; so is
    a shared store's, whose keys are fixed (a WARNING names a torch dtype other than the pool's).
    """
    dtype = getattr(pools.anchor, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return config
    name = str(dtype).removeprefix("torch.")
    if config.kv_dtype == name:
        return config
    if store is None and "kv_dtype" not in config.model_fields_set:
        return config.model_copy(update={"kv_dtype": name})
    if isinstance(getattr(torch, config.kv_dtype, None), torch.dtype):
        log.warning(
            "hicache: kv_dtype=%r but the KV pool holds %s; pages are keyed as %r (set kv_dtype=%r "
            "to key them as what they are)",
            config.kv_dtype,
            name,
            config.kv_dtype,
            name,
        )
    return config


def _check_same_store_config(config: StorageConfig, store: Store) -> None:
    """A shared store keys pages by the config it was opened with: a controller whose config names
    another model, rank, dtype, layout or backend would read and write under the wrong keys."""
    mine = config.model_dump(exclude={"controller"})
    theirs = store.config.model_dump(exclude={"controller"})
    differ = sorted(k for k in mine if mine[k] != theirs.get(k))
    if differ:
        raise ConfigError(
            f"config differs from the config store {store.name!r} was opened with in {differ}; pass "
            "the store's own config (store.config, with any controller settings of your own) or "
            "let the controller open its own store"
        )


def _request(page_hashes: Sequence[str], owner: Ownership | None) -> Request:
    if not isinstance(page_hashes, (list, tuple)) and isinstance(
        page_hashes, (str, bytes, set, frozenset, Mapping)
    ):  # a set has no page order
        raise BatchTypeError(
            f"page_hashes must be an ordered sequence of hash strings, not a {type(page_hashes).__name__}"
        )
    try:
        return Request(page_hashes, owner)
    except HiCacheError:
        raise
    except TypeError:  # not iterable
        raise BatchTypeError(
            f"page_hashes must be a sequence of hash strings, got {type(page_hashes).__name__}"
        ) from None


def _whole(name: PoolName, pool: HostPool, n: int) -> Plan:
    """A plan over every position of an ``n``-page request (for existence checks only)."""
    return Plan(name, pool, range(n), [0] * n)


def _prefix(plan: Plan, pages: int) -> Plan:
    """``plan`` limited to the prefix ``[0, pages)``; a trailing pool's slots hold its last pages."""
    if plan.pool.hit_policy is HitPolicy.TRAILING_PAGES:
        k = min(len(plan.indices), pages)
        return Plan(plan.name, plan.pool, range(pages - k, pages), plan.indices[len(plan.indices) - k :])
    return plan.window(0, pages)


class _Progress:
    """A prefetch's target plans and per-page flags, filled in place as batches land, so that a
    deadline can report the pages loaded so far (:meth:`result`)."""

    __slots__ = ("draft", "flags", "pages", "plans")

    def __init__(self) -> None:
        self.plans: list[Plan] = []
        self.flags: dict[PoolName, list[bool]] = {}
        self.pages = 0
        self.draft: list[bool] | None = None

    def start(self, plans: list[Plan], pages: int, flags: dict[PoolName, list[bool]] | None = None) -> None:
        if flags is None:  # one list per plan, grown by TransferPath.get as batches land
            flags = {}
            for p in plans:
                flags[p.name] = []
        self.flags = flags
        self.plans = plans
        self.pages = pages

    def result(self, req: Request, *, final: bool = False) -> TransferResult:
        """The pages loaded so far. ``final``: the prefetch is over and its flags are complete;
        otherwise a snapshot, padded with False for the pages not read yet."""
        flags = self.flags
        if not final:
            flags = {}
            for p in self.plans:
                f = list(self.flags.get(p.name, ()))
                f += [False] * (len(p.positions) - len(f))
                flags[p.name] = f
        pages = usable(self.plans, flags, self.pages, anchored=True) if self.plans else 0
        return TransferResult(pages, flags, self.draft, 0, tuple(req.errors))


def _all_pages(plans: list[Plan], name: PoolName) -> bool:
    return any(p.name is name and p.pool.hit_policy is HitPolicy.ALL_PAGES for p in plans)
