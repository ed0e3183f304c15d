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

SGLang's own controller does the orchestration (batching, exists-before-get, rank agreement,
prefetch policies), so the adapter drives the hicache ``Store`` directly rather than a
``CacheController``, which would orchestrate a second time and change the per-call results.
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
    DraftIoMode,
    HiCacheError,
    IoOp,
    KeyFormatError,
    Layout,
    OperationNotSupportedError,
    PoolError,
    PoolName,
    PoolTransfer,
    Store,
    check_page_hash,
    load_backend_class,
    open_store,
)

from ._config import AdapterSettings, config_kv_dtype, dtype_name, parse_extra_config, storage_config
from ._pools import SGLangPoolView, build_pool_view, pool_name
from ._stats import StatsDelta

__all__ = ["HiCacheAdapter"]

log = logging.getLogger("hicache.sglang")
T = TypeVar("T")
# (pool, page hashes, host page indices) of one pool's share of a batch
_Part = tuple[PoolName, list[str], list[int]]


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
        self._views: dict[PoolName, SGLangPoolView] = {}
        self._pending: dict[PoolName, Any] = {}
        self._draft_off: str | None = None
        self._use_v2 = False
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
            raise PoolError(
                "hicache-sglang: no KV host pool registered yet; SGLang calls register_mem_pool_host() "
                "right after creating the backend (tests must do the same)"
            )
        return self._store

    def _open(self, kv_pool: Any) -> None:
        layout = str(getattr(kv_pool, "layout", None) or "page_first")
        kv_dtype = config_kv_dtype(self.storage_config, self.settings) or dtype_name(
            getattr(kv_pool, "dtype", "bfloat16")
        )
        config = self._config_for(layout, kv_dtype)
        self._store = open_store(config)
        caps = self._store.capabilities
        self._use_v2 = caps.v2 and (config.layout is Layout.PAGE_FIRST or not caps.zero_copy)
        if not (self._use_v2 or caps.v1):
            self._store.close()
            self._store = None
            raise PoolError(
                f"hicache-sglang: backend {config.backend!r} only implements zero-copy v2, which needs "
                f"--hicache-mem-layout page_first (SGLang's host layout is {layout!r})"
            )
        log.info(
            "hicache-sglang: opened backend %r (%s path, namespace %s)",
            config.backend,
            "v2" if self._use_v2 else "v1",
            self._store.keys.scheme.namespace,
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

    def _pages(self, view: SGLangPoolView, host_indices: Any, n: int) -> list[int]:
        """Host page indices from SGLang's token indices (one page per key)."""
        ps = view.page_size
        if host_indices is None:
            raise PoolError("host_indices is None")
        flat = (
            host_indices.reshape(-1) if isinstance(host_indices, torch.Tensor) else torch.tensor(host_indices)
        )
        if flat.numel() != n * ps:
            raise PoolError(
                f"{flat.numel()} host indices for {n} keys of pool with page_size {ps}; SGLang passes "
                "len(keys) * page_size token indices"
            )
        firsts = flat[::ps].to(torch.int64)
        if bool((firsts % ps).any()):
            raise PoolError(f"host indices are not aligned to the page size {ps}")
        return view.check_indices((firsts // ps).tolist())

    def _io(self, op: IoOp, parts: Sequence[_Part]) -> list[list[bool]]:
        """One store call for every part; one list of per-page bools per part."""
        store = self.store
        if self._use_v2:
            transfers = [
                PoolTransfer(
                    name,
                    tuple(pages) if op is not IoOp.EXISTS else (0,) * len(hashes),
                    tuple(hashes),
                    self._view(name).hit_policy,
                    tuple(store.page_keys(name, hashes)) if hashes else (),
                )
                for name, hashes, pages in parts
            ]
            return store.batch_io_v2(op, transfers)
        keys: list[str] = []
        views: list[torch.Tensor] = []
        ncomp: list[int] = []
        for name, hashes, pages in parts:
            view = self._view(name)
            ncomp.append(len(view.components))
            for k in store.page_keys(name, hashes) if hashes else []:
                keys.extend(k)
            if op is not IoOp.EXISTS:
                for v in view.page_views(pages):
                    views.extend(v)
        flat = store.batch_io_v1(op, keys, None if op is IoOp.EXISTS else views) if keys else []
        out, off = [], 0
        for (_, hashes, _), c in zip(parts, ncomp):
            part = flat[off : off + len(hashes) * c]
            off += len(hashes) * c
            out.append([all(part[j : j + c]) for j in range(0, len(part), c)])
        return out

    def _set(self, parts: Sequence[_Part]) -> list[list[bool]]:
        """Write pages that are not stored yet; pages already present report ``True``."""
        present = self._io(IoOp.EXISTS, parts)
        missing: list[_Part] = []
        where: list[tuple[int, list[int]]] = []
        for p, (part, ex) in enumerate(zip(parts, present)):
            sel = [i for i, e in enumerate(ex) if not e]
            if sel:
                name, hashes, pages = part
                missing.append((name, [hashes[i] for i in sel], [pages[i] for i in sel]))
                where.append((p, sel))
        if missing:
            for (p, sel), ok in zip(where, self._io(IoOp.SET, missing)):
                for i, flag in zip(sel, ok):
                    present[p][i] = flag
        return present

    # ------------------------------------------------------------------- v1
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` are stored (every KV component present)."""

        def run() -> int:
            flags = self._io(IoOp.EXISTS, [(PoolName.KV, list(keys), [0] * len(keys))])[0]
            return flags.index(False) if False in flags else len(flags)

        return self._guard("batch_exists", lambda: 0, run) if keys else 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read KV pages into the host pool at ``host_indices``; one bool per page."""
        if not keys:
            return []

        def run() -> list[bool]:
            pages = self._pages(self._view(PoolName.KV), host_indices, len(keys))
            return self._io(IoOp.GET, [(PoolName.KV, list(keys), pages)])[0]

        return self._guard("batch_get_v1", lambda: [False] * len(keys), run)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store KV pages from the host pool at ``host_indices`` (skipping stored ones); one bool per page."""
        if not keys:
            return []

        def run() -> list[bool]:
            pages = self._pages(self._view(PoolName.KV), host_indices, len(keys))
            return self._set([(PoolName.KV, list(keys), pages)])[0]

        return self._guard("batch_set_v1", lambda: [False] * len(keys), run)

    # ------------------------------------------------------------------- v2
    def _draft_disabled(self, name: PoolName) -> bool:
        return name is PoolName.DRAFT and self._draft_off is not None

    def _batch_io_v2(self, op: IoOp, transfers: Sequence[Any]) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        parts: list[_Part] = []
        slots: list[Any] = []
        for t in transfers:
            keys = list(t.keys or [])
            results[t.name] = [False] * len(keys)
            try:
                name = pool_name(t.name)
                if self._draft_disabled(name) or not keys:
                    continue
                pages = self._pages(self._view(name), t.host_indices, len(keys))
            except HiCacheError as err:
                log.error("hicache-sglang: batch_%s_v2 skipped pool %s: %s", op.value, t.name, err)
                continue
            parts.append((name, keys, pages))
            slots.append(t.name)
        if parts:
            flags = self._set(parts) if op is IoOp.SET else self._io(op, parts)
            for slot, ok in zip(slots, flags):
                results[slot] = ok
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
        parts: list[_Part] = [(PoolName.KV, keys, [0] * n)]
        checked: list[tuple[Any, PoolName]] = []
        for t in transfers:
            name = pool_name(t.name)
            if self._draft_disabled(name):
                continue  # a disabled draft never limits the target prefix
            if name not in self._views:
                raise PoolError(f"pool {name.value!r} is not registered")
            if t.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise PoolError(f"unsupported pool hit policy {t.hit_policy!r} for pool {name.value!r}")
            if name is not PoolName.KV:
                parts.append((name, keys, [0] * n))
            checked.append((t, name))
        found = self._io(IoOp.EXISTS, parts)
        kv = found[0]
        kv_pages = kv.index(False) if False in kv else n
        have = {name: f for (name, _, _), f in zip(parts, found)}
        hit_count: dict[Any, int] = {SGLangPoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t, name in checked:
            if not restorable:
                break
            f = have[name]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = f.index(False) if False in f[:kv_pages] else kv_pages
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
    def _split_key(self, key: str) -> tuple[PoolName, str]:
        """``"{hash}"`` -> KV; ``"{hash}.{pool}"`` (``HiCacheFile``'s component keys, ``.draft``)."""
        page_hash, _, pool = str(key).partition(".")
        name = pool_name(pool) if pool else PoolName.KV
        return name, check_page_hash(page_hash)

    def _page_buffers(self, name: PoolName, tensor: Any) -> list[torch.Tensor]:
        """Split a flat data page (SGLang ``get_data_page(flat=True)``) into component buffers."""
        if not isinstance(tensor, torch.Tensor):
            raise KeyFormatError(
                "hicache-sglang: legacy get/set take a flat page tensor (SGLang's generic page path); "
                f"got {type(tensor).__name__}"
            )
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise PoolError("hicache-sglang: legacy page tensors must be contiguous CPU tensors")
        view = self._view(name)
        flat = tensor.view(-1).view(torch.uint8)
        if flat.numel() != view.page_nbytes:
            raise PoolError(
                f"hicache-sglang: flat page of {flat.numel()} bytes for pool {name.value!r} whose "
                f"pages hold {view.page_nbytes} bytes"
            )
        out, off = [], 0
        for n in view.component_nbytes:
            out.append(flat[off : off + n])
            off += n
        return out

    def _legacy(self, op: IoOp, keys: Sequence[str], tensors: Sequence[Any] | None) -> list[bool]:
        """Legacy per-key I/O through the v1 copy path; one bool per key."""
        store = self.store
        flat_keys: list[str] = []
        bufs: list[torch.Tensor] = []
        counts: list[int] = []
        for i, key in enumerate(keys):
            name, page_hash = self._split_key(key)
            if self._draft_disabled(name):
                counts.append(0)
                continue
            page_keys = store.page_keys(name, [page_hash])[0]
            flat_keys.extend(page_keys)
            counts.append(len(page_keys))
            if tensors is not None:
                value = tensors[i].contiguous() if op is IoOp.SET else tensors[i]
                bufs.extend(self._page_buffers(name, value))
        if op is IoOp.SET:
            present = store.batch_io_v1(IoOp.EXISTS, flat_keys) if flat_keys else []
            todo = [j for j, e in enumerate(present) if not e]
            if todo:
                wrote = store.batch_io_v1(IoOp.SET, [flat_keys[j] for j in todo], [bufs[j] for j in todo])
                for j, ok in zip(todo, wrote):
                    present[j] = ok
            flags = present
        else:
            flags = store.batch_io_v1(op, flat_keys, None if op is IoOp.EXISTS else bufs) if flat_keys else []
        out, off = [], 0
        for c in counts:
            out.append(c > 0 and all(flags[off : off + c]))
            off += c
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
            self._views.clear()
        if store is not None:
            store.close()
