"""``HiCacheAdapter``: any hicache backend behind SGLang's ``HiCacheStorage`` interface.

SGLang loads it as a ``dynamic`` storage backend and constructs it as
``HiCacheAdapter(storage_config, kwargs)``. The hicache store is opened when SGLang registers the
KV host pool (``register_mem_pool_host``), because only then are the layout and the KV dtype
known; every host pool becomes a zero-copy :class:`~hicache_sglang._pools.SGLangPoolView`.

Semantics follow SGLang's (``sglang.srt.mem_cache.hicache_storage``):

* SGLang host indices are TOKEN indices, ``numel == len(keys) * pool.page_size``; the page of
  key ``i`` is ``host_indices[i * page_size] // page_size`` (Mamba pools have page size 1);
* page hashes go unchanged into hicache's key scheme (``store.page_keys``);
* ``batch_exists`` counts leading pages; ``batch_*_v1`` return one bool per page; v2 returns
  ``{transfer.name: [bool per page]}`` and ``batch_exists_v2`` applies SGLang's hit policies
  (``ALL_PAGES``, ``TRAILING_PAGES``) exactly as ``HiCacheFile`` does;
* sets skip pages that already exist (reported ``True``);
* no I/O method raises: SGLang runs them on daemon threads that die on an exception, so every
  failure is logged (with the backend named) and reported as missing pages.

Every I/O method only translates: SGLang's keys and token indices become a hicache
``Request`` and one ``Plan`` per pool, which go through the core's ``TransferPath`` (the path
``CacheController`` uses for every batch: the v1 / v2 choice of ``select_io_path``, component
results folded into pages, sets that skip stored pages, rank 0 alone writing rank-replicated
pools), and the per-page flags come back in SGLang's shapes. Draft pages go first, in their own
request, so a draft failure never touches the target pages. SGLang's own controller does the
request-level orchestration (exists-before-get, rank agreement, prefetch policies), so the
adapter asks the path for per-page facts (``until_miss=False``; only ``batch_exists``, which
counts leading pages, stops at the first miss) rather than going through a ``CacheController``,
which would orchestrate a second time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolTransferResult,
)
from sglang.srt.mem_cache.hicache_storage import PoolName as SGLangPoolName

from hicache_core import (
    ConfigError,
    DraftIoMode,
    HiCacheError,
    IoOp,
    OperationNotSupportedError,
    PoolError,
    PoolName,
    Store,
    check_page_hash,
    load_backend_class,
    open_store,
)
from hicache_core.transfer import Plan, Request, TransferPath, select_io_path

from ._config import AdapterSettings, config_kv_dtype, dtype_name, parse_extra_config, storage_config
from ._pools import FlatPages, SGLangPoolView, build_pool_view, pool_name
from ._stats import StatsDelta

__all__ = ["HiCacheAdapter"]

log = logging.getLogger("hicache.sglang")
T = TypeVar("T")
_NOT_OPEN = (
    "hicache-sglang: no KV host pool registered yet; SGLang calls register_mem_pool_host() right "
    "after creating the backend (tests must do the same)"
)


def _leading(flags: Sequence[bool]) -> int:
    """Length of the leading run of ``True`` (the stored prefix: page hashes chain)."""
    return flags.index(False) if False in flags else len(flags)


def _pool_kv_dtype(kv_pool: Any) -> str:
    """The KV host pool's dtype as the namespace's KV dtype; ``uint8`` is refused as ambiguous.

    SGLang stores every fp8 (and fp4) KV format as ``uint8`` bytes, so ``fp8_e4m3`` and
    ``fp8_e5m2`` servers would share keys and read each other's pages as their own format.
    """
    name = dtype_name(getattr(kv_pool, "dtype", "bfloat16"))
    if name == "uint8":
        raise ConfigError(
            "hicache-sglang: the KV host pool holds uint8 bytes, which SGLang uses for every fp8/fp4 "
            "KV cache format, so its dtype cannot name the key namespace; set 'hicache_kv_dtype' in "
            "--hicache-storage-backend-extra-config to SGLang's --kv-cache-dtype "
            '(e.g. "hicache_kv_dtype": "fp8_e4m3")'
        )
    return name


class HiCacheAdapter(HiCacheStorage):  # type: ignore[misc]
    """SGLang ``HiCacheStorage`` over a hicache store (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.kwargs = dict(kwargs or {})
        self.settings: AdapterSettings = parse_extra_config(storage_config.extra_config)
        load_backend_class(self.settings.backend)  # unknown / broken backend: fail at construction
        # Validate the translation now; the store opens when the KV pool is registered.
        self._config_for("page_first" if storage_config.is_page_first_layout else "layer_first", "bfloat16")
        self._store: Store | None = None
        self._path: TransferPath | None = None  # pages of the registered pools
        self._flat_path: TransferPath | None = None  # legacy flat pages: v1 copies only
        self._views: dict[PoolName, SGLangPoolView] = {}
        self._pending: dict[PoolName, Any] = {}
        self._draft_off: str | None = None
        self._lock = threading.RLock()
        self._stats = StatsDelta()
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}

    # ---------------------------------------------------------------- set-up
    def _config_for(self, layout: str, kv_dtype: str) -> Any:
        return storage_config(self.storage_config, self.settings, sglang_layout=layout, kv_dtype=kv_dtype)

    @property
    def store(self) -> Store:
        """The hicache store (opened by ``register_mem_pool_host``)."""
        if self._store is None:
            raise PoolError(_NOT_OPEN)
        return self._store

    @property
    def path(self) -> TransferPath:
        """The transfer path over the store (built by ``register_mem_pool_host``)."""
        if self._path is None:
            raise PoolError(_NOT_OPEN)
        return self._path

    def _open(self, kv_pool: Any) -> None:
        layout = str(getattr(kv_pool, "layout", None) or "page_first")
        kv_dtype = config_kv_dtype(self.storage_config, self.settings) or _pool_kv_dtype(kv_pool)
        config = self._config_for(layout, kv_dtype)
        store = open_store(config)
        io_path = select_io_path(store.capabilities, config.layout)
        if io_path is None:
            store.close()
            raise PoolError(
                f"hicache-sglang: backend {config.backend!r} only implements zero-copy v2, which needs "
                f"--hicache-mem-layout page_first (SGLang's host layout is {layout!r})"
            )
        batch, owner = config.controller.batch_pages, config.tp_rank == 0
        self._store = store
        self._path = TransferPath(store, io_path, batch_pages=batch, owner=owner)
        self._flat_path = TransferPath(store, "v1", batch_pages=batch, owner=owner)
        log.info(
            "hicache-sglang: opened backend %r (%s path, namespace %s)",
            config.backend,
            io_path,
            store.keys.scheme.namespace,
        )

    def _register(self, name: PoolName, pool: Any) -> None:
        view = self._views.get(name)
        if view is not None and view.source is pool:
            return
        store = self.store
        if name is PoolName.DRAFT:
            declared = store.draft_io()
            if declared.mode is DraftIoMode.UNSUPPORTED or PoolName.DRAFT not in store.capabilities.pools:
                self._draft_off = declared.reason or "the backend does not store the 'draft' pool"
                log.warning(
                    "hicache-sglang: draft KV offload disabled for backend %r: %s (target KV unaffected)",
                    store.name,
                    self._draft_off,
                )
                return
        view = build_pool_view(name, pool, is_mla_model=bool(self.storage_config.is_mla_model))
        store.register_pool(name, view)
        self._views[name] = view

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for this KV pool's layout and dtype, and register it as ``kv``."""
        super().register_mem_pool_host(mem_pool_host)
        anchor = getattr(getattr(mem_pool_host, "anchor_entry", None), "host_pool", mem_pool_host)
        with self._lock:
            if self._store is None:
                self._open(anchor)
            self._register(PoolName.KV, anchor)
            pending, self._pending = self._pending, {}
            for name, pool in pending.items():
                self._register(name, pool)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register a host pool of SGLang's pool group (KV again, Mamba, indexer, draft)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_name(host_pool_name)
        with self._lock:
            if self._store is None:
                if name is PoolName.KV:
                    self.register_mem_pool_host(host_pool)
                else:
                    self._pending[name] = host_pool
                return
            self._register(name, host_pool)

    # ------------------------------------------------------------- plumbing
    def _guard(self, what: str, fallback: Callable[[], T], fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as err:
            backend = self._store.name if self._store is not None else self.settings.backend
            log.error(
                "hicache-sglang: %s failed on backend %r: %s: %s",
                what,
                backend,
                type(err).__name__,
                err,
                exc_info=not isinstance(err, HiCacheError),
            )
            return fallback()

    def _view(self, name: PoolName) -> SGLangPoolView:
        try:
            return self._views[name]
        except KeyError:
            raise PoolError(
                f"hicache-sglang: pool {name.value!r} is not registered (registered: "
                f"{[p.value for p in self._views]})"
            ) from None

    def _plan(self, name: PoolName, first: int, n: int, host_indices: Any = None) -> Plan:
        """Pool ``name``'s plan for request positions ``[first, first + n)``, from SGLang's token
        ``host_indices``; without them an existence probe (no host pages)."""
        view = self._view(name)
        pages = [0] * n if host_indices is None else view.token_pages(host_indices, n)
        return Plan(name, view, list(range(first, first + n)), pages)

    def _run(
        self, op: IoOp, hashes: Sequence[str], plans: Sequence[Plan], path: TransferPath | None = None
    ) -> dict[PoolName, list[bool]]:
        """Per-page facts for ``plans`` from the transfer path (every page asked, SGLang decides).

        A draft plan runs first and in its own request, so a draft failure never touches the
        target pages.
        """
        path = path or self.path
        out: dict[PoolName, list[bool]] = {}
        draft = [p for p in plans if p.name is PoolName.DRAFT]
        for group in (draft, [p for p in plans if p.name is not PoolName.DRAFT]):
            if not group:
                continue
            req = Request(hashes)
            if op is IoOp.SET:
                out.update(path.put(req, group)[0])
            elif op is IoOp.GET:
                out.update(path.get(req, group, until_miss=False))
            else:
                out.update(path.exists(req, group, until_miss=False))
        return out

    def _kv(self, op: IoOp, keys: list[str], host_indices: Any) -> list[bool]:
        return self._run(op, keys, [self._plan(PoolName.KV, 0, len(keys), host_indices)])[PoolName.KV]

    # ------------------------------------------------------------------- v1
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` are stored (every KV component present)."""

        def run() -> int:
            plan = self._plan(PoolName.KV, 0, len(keys))
            return _leading(self.path.exists(Request(keys), [plan])[PoolName.KV])  # stops at a miss

        return self._guard("batch_exists", lambda: 0, run) if keys else 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read KV pages into the host pool at ``host_indices``; one bool per page."""
        if not keys:
            return []
        fallback = [False] * len(keys)
        return self._guard("batch_get_v1", lambda: fallback, lambda: self._kv(IoOp.GET, keys, host_indices))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store KV pages from the host pool at ``host_indices`` (skipping stored ones); one bool per page."""
        if not keys:
            return []
        fallback = [False] * len(keys)
        return self._guard("batch_set_v1", lambda: fallback, lambda: self._kv(IoOp.SET, keys, host_indices))

    # ------------------------------------------------------------------- v2
    def _draft_disabled(self, name: PoolName) -> bool:
        return name is PoolName.DRAFT and self._draft_off is not None

    def _batch_io_v2(self, op: IoOp, transfers: Sequence[Any]) -> dict[Any, list[bool]]:
        """One request over every transfer: transfer ``t``'s keys are one run of its positions."""
        results: dict[Any, list[bool]] = {}
        hashes: list[str] = []
        plans: dict[PoolName, tuple[Any, Plan]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            results[t.name] = [False] * len(keys)
            try:
                name = pool_name(t.name)
                if self._draft_disabled(name) or not keys:
                    continue
                if name in plans:
                    raise PoolError(f"pool {name.value!r} appears twice in one call")
                plans[name] = (t.name, self._plan(name, len(hashes), len(keys), t.host_indices))
            except HiCacheError as err:
                log.error("hicache-sglang: batch_%s_v2 skipped pool %s: %s", op.value, t.name, err)
                continue
            hashes.extend(keys)
        if plans:
            flags = self._run(op, hashes, [plan for _, plan in plans.values()])
            for name, (slot, _) in plans.items():
                results[slot] = flags[name]
        return results

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read each transfer's pages into its pool; ``{transfer.name: [bool per page]}``."""
        return self._guard(
            "batch_get_v2",
            lambda: {t.name: [False] * len(t.keys or []) for t in transfers},
            lambda: self._batch_io_v2(IoOp.GET, transfers),
        )

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's pages (skipping stored ones); ``{transfer.name: [bool per page]}``."""
        return self._guard(
            "batch_set_v2",
            lambda: {t.name: [False] * len(t.keys or []) for t in transfers},
            lambda: self._batch_io_v2(IoOp.SET, transfers),
        )

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[Any] | None = None, extra_info: Any = None
    ) -> Any:
        """The restorable prefix over KV and every transfer's pool, under SGLang's hit policies.

        Same rules as SGLang's ``HiCacheFile``: the KV prefix is the leading run of stored pages;
        an ``ALL_PAGES`` pool must hold every page of a prefix, a ``TRAILING_PAGES`` pool only the
        last ``max(1, len(transfer.keys))`` pages. ``restorable_prefix_pages`` lists every legal
        stop point; ``kv_hit_pages`` is the largest.
        """
        return self._guard(
            "batch_exists_v2",
            lambda: PoolTransferResult(0, {}, []),
            lambda: self._exists_v2(list(keys), list(pool_transfers or [])),
        )

    def _exists_v2(self, keys: list[str], transfers: list[Any]) -> Any:
        if not keys:
            return PoolTransferResult(0, {}, [])
        n = len(keys)
        plans = {PoolName.KV: self._plan(PoolName.KV, 0, n)}
        checked: list[tuple[Any, PoolName]] = []
        for t in transfers:
            name = pool_name(t.name)
            if self._draft_disabled(name):
                continue  # a disabled draft never limits the target prefix
            if name not in plans:
                plans[name] = self._plan(name, 0, n)
            if t.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise PoolError(f"unsupported pool hit policy {t.hit_policy!r} for pool {name.value!r}")
            checked.append((t, name))
        have = self._run(IoOp.EXISTS, keys, list(plans.values()))
        kv_pages = _leading(have[PoolName.KV])
        hit_count: dict[Any, int] = {SGLangPoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t, name in checked:
            if not restorable:
                break
            f = have[name]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = min(_leading(f), kv_pages)
                pool_ok = set(range(1, boundary + 1))
            else:
                trailing = max(1, len(t.keys) if t.keys else 1)
                pool_ok = {p for p in range(1, kv_pages + 1) if all(f[max(0, p - trailing) : p])}
                boundary = max(pool_ok, default=0)
            if boundary:
                hit_count[t.name] = boundary
            restorable = [p for p in restorable if p in pool_ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    # --------------------------------------------------------------- legacy
    def _legacy(self, op: IoOp, keys: Sequence[str], tensors: Sequence[Any] | None) -> list[bool]:
        """Per-key I/O of flat pages (v1 copy path); ``"{hash}"`` is a KV page, ``"{hash}.{pool}"``
        a page of that pool (``HiCacheFile``'s keys, e.g. ``.draft``). One bool per key."""
        groups: dict[PoolName, list[tuple[int, str]]] = {}
        for i, key in enumerate(keys):
            page_hash, _, pool = str(key).partition(".")
            name = pool_name(pool) if pool else PoolName.KV
            if not self._draft_disabled(name):
                groups.setdefault(name, []).append((i, check_page_hash(page_hash)))
        hashes: list[str] = []
        plans: list[Plan] = []
        for name, items in groups.items():  # each pool's keys: one run of request positions
            view, k = self._view(name), len(items)
            positions = list(range(len(hashes), len(hashes) + k))
            if tensors is None:  # existence: no host pages
                plans.append(Plan(name, view, positions, [0] * k))
            else:
                values = [tensors[i].contiguous() if op is IoOp.SET else tensors[i] for i, _ in items]
                plans.append(Plan(name, FlatPages(name, view, values), positions, list(range(k))))
            hashes.extend(h for _, h in items)
        path = self._flat_path if tensors is not None else None  # flat pages: v1 copies only
        flags = self._run(op, hashes, plans, path) if plans else {}
        out = [False] * len(keys)
        for name, items in groups.items():
            for (i, _), ok in zip(items, flags[name]):
                out[i] = ok
        return out

    def exists(self, key: str) -> bool:
        """Whether every component of page ``key`` (``"{hash}"`` or ``"{hash}.{pool}"``) is stored."""
        return self._guard("exists", lambda: False, lambda: self._legacy(IoOp.EXISTS, [key], None)[0])

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read page ``key`` into the flat page tensor ``target_location``; it, or ``None`` on a miss."""
        ok = self._guard("get", lambda: False, lambda: self._legacy(IoOp.GET, [key], [target_location])[0])
        return target_location if ok else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read pages into flat page tensors; per key the tensor, or ``None`` on a miss."""
        if not keys:
            return []
        targets = list(target_locations or [None] * len(keys))
        flags = self._guard(
            "batch_get", lambda: [False] * len(keys), lambda: self._legacy(IoOp.GET, keys, targets)
        )
        return [t if ok else None for t, ok in zip(targets, flags)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store the flat page tensor ``value`` as page ``key`` (``True`` if already stored)."""
        return self._guard("set", lambda: False, lambda: self._legacy(IoOp.SET, [key], [value])[0])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store flat page tensors; ``True`` when every page is stored."""
        if not keys:
            return True
        vals = list(values or [None] * len(keys))
        return all(
            self._guard("batch_set", lambda: [False] * len(keys), lambda: self._legacy(IoOp.SET, keys, vals))
        )

    # ---------------------------------------------------------------- admin
    def clear(self) -> bool:
        """Remove this model's namespace from storage (other models, dtypes, layouts are untouched)."""

        def run() -> bool:
            removed = self.store.clear()
            log.info("hicache-sglang: cleared %d objects of namespace %s", removed, self.namespace)
            return True

        try:
            return run()
        except OperationNotSupportedError as err:
            log.warning("hicache-sglang: clear is not supported: %s", err)
            return False
        except Exception as err:
            log.error("hicache-sglang: clear failed: %s: %s", type(err).__name__, err)
            return False

    @property
    def namespace(self) -> str:
        """The key namespace of this rank's pages (model identity, KV dtype, layout)."""
        return self.store.keys.scheme.namespace

    def get_stats(self) -> Any:
        """SGLang ``StorageMetrics`` since the last call, from the ``metrics`` extension (else ``None``)."""
        ext = self._store.extensions.get("metrics") if self._store is not None else None
        snapshot = getattr(ext, "snapshot", None)
        if snapshot is None:
            return None
        return self._guard("get_stats", lambda: None, lambda: self._stats(snapshot()))

    def close(self) -> None:
        """Close the hicache store (SGLang calls this on detach)."""
        with self._lock:
            store, self._store = self._store, None
            self._path = self._flat_path = None
            self._views.clear()
        if store is not None:
            store.close()
