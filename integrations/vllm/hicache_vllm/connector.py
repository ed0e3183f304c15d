"""``HiCacheConnector``: any hicache backend as a vLLM KV store (``KVConnectorBase_V1``).

Load it with::

    KVTransferConfig(kv_connector="HiCacheConnector", kv_connector_module_path="hicache_vllm",
                     kv_role="kv_both", kv_connector_extra_config={"backend": "file",
                     "options": {"root": "/var/cache/hicache"}})

or the same JSON on ``vllm serve --kv-transfer-config``. vLLM builds one instance in the
scheduler (``SchedulerSide``: page hashes, one batched existence query per new request, the
loads and saves of each step) and one per worker (``WorkerSide``: vLLM's KV cache viewed in place
as a hicache pool; loads before the forward pass, saves after it). Both open the store with
the same ``StorageConfig`` apart from the rank, so their keys agree: the workers report the
layout of their pool (part of the key namespace) through vLLM's connector handshake at start-up,
and the scheduler asks about tensor-parallel rank 0's pages (MLA: the one key of every rank).

A hicache store is a cache: a page that fails to load is recomputed. The connector therefore
runs vLLM with ``kv_load_failure_policy="recompute"`` (it sets it, with a log line, when the
config says ``"fail"``): failed blocks are reported through ``get_block_ids_with_load_errors``
and vLLM recomputes them instead of failing the request. vLLM records a request's cached tokens
(``num_cached_tokens``) when it admits it, before a synchronous load runs; the worker sends the
good leading pages of a load that failed in part back with the step's output, and the scheduler
side corrects the request's prefill statistics (``Request.prefill_stats``, not a connector API:
on a vLLM without it the claim stays) before its first token reports them.

With ``async_load`` the scheduler answers ``(tokens, True)``: vLLM allocates the request's
blocks, keeps it out of the batch, and the worker loads its pages on a background thread,
reporting it in ``get_finished``'s ``finished_recving`` once every page is in place or failed.
A load that failed in part is reported in ``failed_recving`` (the same step or earlier) with the
number of good leading pages in the worker metadata: vLLM drops the request's blocks and asks
``get_num_new_matched_tokens`` again, which then claims only the good pages, so the request's
``num_cached_tokens`` counts what was really loaded (those pages are read a second time). vLLM
keeps the blocks of a request aborted meanwhile until that report, and the worker cancels a
load not yet started for an aborted request, so nothing writes a block vLLM may reuse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from hicache_core import ComponentSpec, ConfigError, HostPool, Layout, PoolName, open_store
from hicache_core.transfer import TransferPath, select_io_path

from ._config import ConnectorSettings, PageFormat, parse_extra_config, storage_config
from ._scheduler import PageOp, SchedulerSide
from ._worker import WorkerSide, check_io_timeout

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["HiCacheConnector", "HiCacheConnectorMetadata"]

log = logging.getLogger("hicache.vllm")


@dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """Scheduler -> worker, once per step: pages to load and to save, and whether any request
    was preempted (its blocks may be reused: saves in flight must finish first)."""

    loads: list[PageOp] = field(default_factory=list)
    saves: list[PageOp] = field(default_factory=list)
    async_loads: list[PageOp] = field(default_factory=list)
    preempted: bool = False


@dataclass
class HiCacheWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """Worker -> scheduler: failed asynchronous loads, request id -> good leading pages."""

    loaded_pages: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, HiCacheWorkerMetadata):
            for req_id, good in other.loaded_pages.items():
                self.loaded_pages[req_id] = min(good, self.loaded_pages.get(req_id, good))
        return self


@dataclass
class HiCacheHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """Worker -> scheduler, once at start-up: the layout of the worker's pool, which names the
    key namespace (the scheduler must ask about the keys the workers write)."""

    layout: str


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    return text[len("torch.") :] if text.startswith("torch.") else text


def page_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> PageFormat:
    """The page byte format of this engine, from vLLM's config (the same on scheduler and workers)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ConfigError(
            f"hicache-vllm: this model has {len(groups)} KV cache groups (hybrid attention); the "
            "connector supports models with one full-attention KV cache group"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec) or getattr(spec, "non_causal", False):
        # Sliding-window and chunked-local caches drop blocks while the request runs (and give
        # the null block for skipped ones); a non-causal prefix's KV depends on later tokens: a
        # page is then not a function of its prefix's token ids.
        kind = type(spec).__name__ + (" (non_causal)" if getattr(spec, "non_causal", False) else "")
        raise ConfigError(
            f"hicache-vllm: this model's KV cache is a {kind}; the connector supports causal "
            "full-attention (FullAttentionSpec) and MLA (MLAAttentionSpec) KV caches only, whose "
            "blocks hold every prompt token: serve this model without the connector (a model "
            "mixing full and sliding-window layers gets a full-attention cache when vLLM's hybrid "
            "KV cache manager is off, --disable-hybrid-kv-cache-manager)"
        )
    try:
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    except Exception:  # not resolved yet in this process: the platform default
        layout = "default"
    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type or "unknown")
    except Exception:
        device = "unknown"
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return PageFormat(
        model=str(model.model),
        revision=getattr(model, "revision", None) or None,
        kv_dtype=_kv_dtype(str(vllm_config.cache_config.cache_dtype), spec),
        device=device,
        layout=layout,
        block_size=int(spec.block_size),
        num_layers=len(groups[0].layer_names),
        is_mla=isinstance(spec, MLAAttentionSpec),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        cp_sharded=any(
            int(getattr(parallel, f"{kind}_context_parallel_size", 1) or 1) > 1
            for kind in ("decode", "prefill")
        ),
    )


def _kv_dtype(cache_dtype: str, spec: Any) -> str:
    """The KV dtype of the key namespace: vLLM's ``--kv-cache-dtype`` string unless ``auto`` (then
    the torch dtype of the cache, the model's). vLLM stores every fp8 variant (``fp8``,
    ``fp8_e4m3``, ``fp8_e5m2``...) as ``uint8``, so the torch dtype cannot tell them apart; each
    string is its own namespace (``fp8``, vLLM's alias of ``fp8_e4m3``, too: a miss, never
    another encoding's bytes)."""
    if cache_dtype != "auto":
        return cache_dtype
    return _dtype_name(spec.dtype)


def _ranks() -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel ranks (0, 0 outside a distributed setup)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception:
        return 0, 0


def _scheduler_side(settings: ConnectorSettings, page: PageFormat, layout: Layout) -> SchedulerSide:
    """The scheduler's store and existence path over rank 0's keys in the workers' ``layout``."""
    config = storage_config(settings, page, tp_rank=0, pp_rank=0, layout=layout)
    store = open_store(config)
    try:
        check_io_timeout(store, config)
        # Existence queries need the pool's component names only (the keys), not its memory.
        pool = HostPool([ComponentSpec("kv", 1, (1,), torch.uint8)], 1, layout=layout)
        pool.rank_replicated = page.rank_replicated  # MLA: the one shared key of every rank
        store.register_pool(PoolName.KV, pool)
        io_path = select_io_path(store.capabilities, pool.layout) or "v1"
        path = TransferPath(store, io_path, batch_pages=config.controller.batch_pages)
    except BaseException:
        store.close()
        raise
    return SchedulerSide(store, pool, path, page.block_size)


class HiCacheConnector(KVConnectorBase_V1):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """vLLM KV connector over a hicache store (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = parse_extra_config(transfer.kv_connector_extra_config)
        self.page = page_format(vllm_config, kv_cache_config)
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.info(
                "hicache-vllm: kv_load_failure_policy set to 'recompute': a page that fails to load "
                "is recomputed (a hicache store is a cache)"
            )
            transfer.kv_load_failure_policy = "recompute"
        # kv_role: "kv_both" loads and saves, "kv_consumer" only loads, "kv_producer" only saves
        self._loads = bool(getattr(transfer, "is_kv_consumer", True))
        self._saves = bool(getattr(transfer, "is_kv_producer", True))
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._saving: set[str] = set()  # requests with saves sent (async_save)
        self._failed_loads: dict[str, int] = {}  # worker: failed loads not yet sent back
        self._sync_loading: dict[str, Request] = {}  # scheduler: requests granted a synchronous load
        if role == KVConnectorRole.SCHEDULER:
            # vLLM's CPU KV cache gives a layer_first pool; the workers' handshake confirms it
            self.scheduler = _scheduler_side(self.settings, self.page, Layout.LAYER_FIRST)
        else:
            tp_rank, pp_rank = _ranks()
            config = storage_config(self.settings, self.page, tp_rank=tp_rank, pp_rank=pp_rank)
            self.worker = WorkerSide(
                config,
                self.page.block_size,
                async_save=self.settings.async_save,
                async_load=self.settings.async_load,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best effort: a dropped save is a future miss

    # ============================================================ scheduler
    @staticmethod
    def _cacheable(request: Request) -> bool:
        """Whether a request's KV is a function of its prompt token ids alone: not with images
        or other multimodal inputs, prompt embeddings, a LoRA adapter or a cache salt (the page
        hashes cover only the token ids, so such requests are neither loaded nor saved)."""
        return bool(
            request.prompt_token_ids
            and getattr(request, "prompt_embeds", None) is None
            and not getattr(request, "mm_features", None)
            and getattr(request, "lora_request", None) is None
            and not getattr(request, "cache_salt", None)
        )

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Every worker's pool layout, keyed by ``(pp_rank, tp_rank)``, before the first request:
        the scheduler asks about the keys rank 0 writes, so it takes rank 0's layout."""
        layouts = {r: m.layout for r, m in metadata.items() if isinstance(m, HiCacheHandshake)}
        if len(set(layouts.values())) > 1:
            log.warning("hicache-vllm: the workers' KV pools differ in layout: %s", layouts)
        layout = layouts.get((0, 0))
        sched = self.scheduler
        if sched is None or layout is None:
            return
        log.info("hicache-vllm: the workers' KV pools are %s: the scheduler asks about those keys", layout)
        if Layout(layout) is sched.store.config.layout:
            return
        self.scheduler = _scheduler_side(self.settings, self.page, Layout(layout))
        sched.close()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, r): m for r, m in metadata.items()})

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.scheduler is None or not self._loads or not self._cacheable(request):
            return 0, False
        prompt = request.prompt_token_ids or []
        n = self.scheduler.matched_tokens(request.request_id, prompt, num_computed_tokens)
        return n, self.settings.async_load and n > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.scheduler is not None and self._cacheable(request):
            prompt = request.prompt_token_ids or []
            async_blocks = None
            if self.settings.async_load and num_external_tokens > 0:
                async_blocks = list(blocks.get_block_ids()[0])
            elif num_external_tokens > 0:
                self._sync_loading[request.request_id] = request
            self.scheduler.after_alloc(request.request_id, prompt, num_external_tokens, async_blocks)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HiCacheConnectorMetadata(preempted=bool(scheduler_output.preempted_req_ids))
        sched = self.scheduler
        if sched is None:
            return meta
        counts = scheduler_output.num_scheduled_tokens
        scheduled = [
            (r.req_id, r.num_computed_tokens, counts.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [
            (rid, n, counts.get(rid, 0)) for rid, n in zip(cached.req_ids, cached.num_computed_tokens)
        ]
        manager = self._kv_cache_manager

        def block_ids(req_id: str) -> list[int]:
            assert manager is not None
            return list(manager.get_block_ids(req_id)[0])

        ops = sched.build(scheduled, block_ids)
        meta.loads, meta.saves = ops.loads, ops.saves if self._saves else []
        meta.async_loads = ops.async_loads
        if self.settings.async_save:
            self._saving.update(op.req_id for op in meta.saves)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self.scheduler is not None and isinstance(meta, HiCacheWorkerMetadata):
            for req_id, good in meta.loaded_pages.items():
                self.scheduler.load_failed(req_id, good)
                request = self._sync_loading.get(req_id)
                if request is not None:
                    self._report_cached(request, good * self.page.block_size)

    @staticmethod
    def _report_cached(request: Request, loaded_tokens: int) -> None:
        """A synchronous load of ``request`` gave only ``loaded_tokens`` of the tokens claimed:
        vLLM recorded the claim in the request's prefill statistics when it admitted it (its
        ``num_cached_tokens``), and the failed step emits no token, so the statistics are
        corrected before the request's first token reports them."""
        stats = getattr(request, "prefill_stats", None)
        if stats is None or not hasattr(stats, "set"):
            return  # first token already reported, or another vLLM: the claim stays
        if loaded_tokens < stats.num_external_cached_tokens:
            stats.set(
                num_prompt_tokens=stats.num_prompt_tokens,
                num_local_cached_tokens=stats.num_local_cached_tokens,
                num_external_cached_tokens=loaded_tokens,
            )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sync_loading.pop(request.request_id, None)
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        if request.request_id in self._saving:
            self._saving.discard(request.request_id)
            return True, None  # blocks stay until the worker reports the saves done
        return False, None

    # =============================================================== worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is None:
            return
        try:
            self.worker.register(kv_caches)
        except ConfigError:
            raise  # a config the backend cannot serve: refused at start-up
        except Exception as err:
            # The engine still serves: every granted load reports failed blocks (recomputed).
            log.error(
                "hicache-vllm: cannot use vLLM's KV cache with backend %r, connector disabled "
                "(every page is recomputed): %s: %s",
                self.settings.backend,
                type(err).__name__,
                err,
            )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        layout = self.worker.layout if self.worker is not None else None
        return HiCacheHandshake(layout.value) if layout is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HiCacheConnectorMetadata)
            self.worker.load(meta.loads)
            self.worker.start_async_loads(meta.async_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every page is loaded in start_load_kv, before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # pages are saved whole (every layer) in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HiCacheConnectorMetadata)
            self.worker.save(meta.saves)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        meta = kv_connector_metadata
        if self.worker is not None and isinstance(meta, HiCacheConnectorMetadata) and meta.preempted:
            self.worker.drain()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        saved = self.worker.finished_saves(finished_req_ids) if self.settings.async_save else None
        loaded = self.worker.finished_loads(finished_req_ids) if self.settings.async_load else None
        return saved or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self.worker is not None and self.settings.async_load:
            failed = self.worker.failed_requests()
            results.failed_recving = set(failed)
            self._failed_loads.update(failed)
        return results

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is not None:
            self._failed_loads.update(self.worker.short_loads())
        if not self._failed_loads:
            return None
        meta, self._failed_loads = HiCacheWorkerMetadata(self._failed_loads), {}
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # ============================================================== metrics
    def stats(self) -> dict[str, Any]:
        """Lookups (scheduler), pages/bytes/seconds moved (worker) and the ``metrics`` extension's
        snapshot of this side's store (hits, misses, bytes, latency), when enabled."""
        out: dict[str, Any] = {}
        store = None
        if self.scheduler is not None:
            out["lookups"] = vars(self.scheduler.stats).copy()
            store = self.scheduler.store
        if self.worker is not None:
            out["transfers"] = vars(self.worker.stats).copy()
            store = self.worker.store
        ext = store.extensions.get("metrics") if store is not None else None
        snapshot = getattr(ext, "snapshot", None)
        if snapshot is not None:
            out["metrics"] = snapshot()
        return out
