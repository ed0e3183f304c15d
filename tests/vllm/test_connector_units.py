"""The connector's vLLM-facing parts without an engine: which requests and KV caches it accepts,
the KV dtype of the key namespace, and the scheduler asking about the keys the workers write
(their pool layout, reported through the handshake; MLA's one shared key)."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_cache_interface")  # the tests folder is on sys.path: not "vllm"

import torch
from hicache_vllm import parse_extra_config
from hicache_vllm._config import PageFormat, storage_config
from hicache_vllm._scheduler import PageOp
from hicache_vllm._worker import WorkerSide
from hicache_vllm.connector import (
    HiCacheConnector,
    HiCacheHandshake,
    _scheduler_side,
    page_format,
)
from vllm import SamplingParams
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from hicache_core import ConfigError, Layout, StorageConfig, Store, open_store, page_hashes

L, B, H, N, D = 2, 8, 2, 4, 16


def _vllm_config(cache_dtype: str = "auto", tp: int = 1) -> Any:
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(model="tiny", revision=None),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        cache_config=types.SimpleNamespace(
            cache_dtype=cache_dtype,
            get_resolved_kv_cache_layout=lambda: types.SimpleNamespace(name="NHD"),
        ),
    )


def _kv_cache_config(spec: Any) -> Any:
    return KVCacheConfig(
        num_blocks=B, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)]
    )


def _full(dtype: torch.dtype = torch.bfloat16, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=dtype, **kw)


def test_prompt_embeddings_are_never_cached() -> None:
    """The page hashes cover the token ids only; vLLM's own prefix cache keys the embeddings."""
    ids = [1, 2, 3, *[9] * 8, 4]
    plain = Request("p", list(ids), SamplingParams(max_tokens=1), None)
    mixed = Request(
        "m",
        list(ids),
        SamplingParams(max_tokens=1),
        None,
        prompt_embeds=torch.randn(len(ids), 8),
        prompt_is_token_ids=[True] * 3 + [False] * 8 + [True],
    )
    assert HiCacheConnector._cacheable(plain)
    assert not HiCacheConnector._cacheable(mixed)


@pytest.mark.parametrize(
    "cache_dtype, namespace_dtype",
    [
        ("auto", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("fp8", "fp8"),
        ("fp8_e4m3", "fp8_e4m3"),
        ("fp8_e5m2", "fp8_e5m2"),
    ],
)
def test_kv_dtype_of_the_namespace_is_vllms_cache_dtype(cache_dtype: str, namespace_dtype: str) -> None:
    """vLLM stores every fp8 variant as uint8: the namespace takes --kv-cache-dtype's string
    (``auto``: the cache's torch dtype, as before)."""
    dtype = torch.bfloat16 if cache_dtype in ("auto", "bfloat16") else torch.uint8
    page = page_format(_vllm_config(cache_dtype), _kv_cache_config(_full(dtype)))
    assert page.kv_dtype == namespace_dtype


def test_fp8_encodings_never_share_keys(tmp_path: Path) -> None:
    settings = parse_extra_config({"backend": "file", "options": {"root": str(tmp_path)}})
    namespaces = set()
    for cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        page = page_format(_vllm_config(cache_dtype), _kv_cache_config(_full(torch.uint8)))
        with open_store(storage_config(settings, page, tp_rank=0, pp_rank=0)) as store:
            namespaces.add(store.keys.scheme.namespace)
    assert len(namespaces) == 3


@pytest.mark.parametrize(
    "spec, name",
    [
        (
            SlidingWindowSpec(
                block_size=N, num_kv_heads=H, head_size=D, dtype=torch.bfloat16, sliding_window=8
            ),
            "SlidingWindowSpec",
        ),
        (
            ChunkedLocalAttentionSpec(
                block_size=N, num_kv_heads=H, head_size=D, dtype=torch.bfloat16, attention_chunk_size=8
            ),
            "ChunkedLocalAttentionSpec",
        ),
        (_full(non_causal=True), r"FullAttentionSpec \(non_causal\)"),
    ],
)
def test_kv_caches_that_drop_or_reorder_blocks_are_refused(spec: Any, name: str) -> None:
    """Sliding-window and chunked-local caches free blocks mid-request and hand out the null
    block for skipped ones: loads and saves would move other requests' bytes."""
    with pytest.raises(ConfigError, match=f"KV cache is a {name}; .*full-attention"):
        page_format(_vllm_config(), _kv_cache_config(spec))


def test_full_attention_and_mla_caches_are_accepted() -> None:
    full = page_format(_vllm_config(tp=2), _kv_cache_config(_full()))
    assert not full.is_mla and not full.rank_replicated
    mla = _kv_cache_config(MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=D, dtype=torch.bfloat16))
    page = page_format(_vllm_config(tp=2), mla)
    assert page.is_mla and page.rank_replicated
    # decode context parallelism gives every rank other tokens of a block: keys per rank
    dcp = _vllm_config(tp=2)
    dcp.parallel_config.decode_context_parallel_size = 2
    page = page_format(dcp, mla)
    assert page.is_mla and not page.rank_replicated
    settings = parse_extra_config({"backend": "file", "options": {"root": "/unused"}})
    assert not storage_config(settings, page, tp_rank=1, pp_rank=0).is_mla_model


def _lbhnc() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    buf = torch.randn(L, B, H, N, 2 * D).to(torch.bfloat16)
    return buf, {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(L)}


def _connector(**attrs: Any) -> HiCacheConnector:
    """A connector with only the attributes a test needs (vLLM's engine builds the real ones)."""
    c = object.__new__(HiCacheConnector)
    for k, v in attrs.items():
        setattr(c, k, v)
    return c


def test_scheduler_asks_about_the_keys_of_the_workers_pool_layout(tmp_path: Path) -> None:
    """The pool layout names the key namespace: the workers report theirs at start-up and the
    scheduler asks about those keys (another layout's are another namespace)."""
    settings = parse_extra_config({"backend": "file", "options": {"root": str(tmp_path)}})
    page = PageFormat("tiny", None, "bfloat16", "cpu", "NHD", N, L, False, 1, 1)
    worker = WorkerSide(storage_config(settings, page, tp_rank=0, pp_rank=0), N, async_save=False)
    worker.register(_lbhnc()[1])
    meta = _connector(worker=worker).get_handshake_metadata()
    assert isinstance(meta, HiCacheHandshake) and meta.layout == "layer_first"
    prompt = list(range(4 * N + 1))
    worker.save([PageOp("r", page_hashes(prompt, N), [1, 2, 3, 4])])
    old = _scheduler_side(settings, page, Layout.PAGE_FIRST)
    c = _connector(settings=settings, page=page, scheduler=old)
    assert old.matched_tokens("r", prompt, 0) == 0  # page_first: another namespace
    c.set_xfer_handshake_metadata_pp_aware({(0, 0): meta, (0, 1): meta})
    assert c.scheduler is not old and c.scheduler.store.config.layout is Layout.LAYER_FIRST
    assert old.store.closed
    assert c.scheduler.matched_tokens("r", prompt, 0) == 4 * N
    c.set_xfer_handshake_metadata({0: meta})  # the same layout again: nothing to rebuild
    kept = c.scheduler
    c.set_xfer_handshake_metadata({0: meta})
    assert c.scheduler is kept
    kept.close()
    worker.close()


def test_mla_scheduler_finds_the_shared_pages_of_every_rank(tmp_path: Path) -> None:
    settings = parse_extra_config({"backend": "file", "options": {"root": str(tmp_path)}})
    page = PageFormat("tiny-mla", None, "bfloat16", "cpu", "NHD", N, L, True, 2, 1)
    buf = torch.randn(L, B, N, D).to(torch.bfloat16)
    w = WorkerSide(storage_config(settings, page, tp_rank=0, pp_rank=0), N, async_save=False)
    w.register({f"l{i}": buf[i] for i in range(L)})
    prompt = list(range(4 * N + 1))
    w.save([PageOp("r", page_hashes(prompt, N), [1, 2, 3, 4])])
    sched = _scheduler_side(settings, page, Layout.LAYER_FIRST)
    assert sched.matched_tokens("r", prompt, 0) == 4 * N
    sched.close()
    w.close()


def test_io_timeout_on_a_v2_only_backend_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both sides refuse it with CacheController's ConfigError; the worker's reaches vLLM (a
    config the backend cannot serve stops the engine instead of disabling the connector)."""
    import hicache_vllm._worker as worker_mod
    import hicache_vllm.connector as connector_mod

    def v2_only(config: StorageConfig) -> Store:
        store = open_store(config)
        store.capabilities = dataclasses.replace(store.capabilities, v1=False, v2=True)
        return store

    monkeypatch.setattr(worker_mod, "open_store", v2_only)
    monkeypatch.setattr(connector_mod, "open_store", v2_only)
    settings = parse_extra_config({"backend": "file", "options": {"root": str(tmp_path)}, "io_timeout_s": 5})
    page = PageFormat("tiny", None, "bfloat16", "cpu", "NHD", N, L, False, 1, 1)
    with pytest.raises(ConfigError, match=r"implements only v2.*io_timeout_s"):
        _scheduler_side(settings, page, Layout.LAYER_FIRST)
    worker = WorkerSide(storage_config(settings, page, tp_rank=0, pp_rank=0), N, async_save=False)
    with pytest.raises(ConfigError, match=r"implements only v2.*io_timeout_s"):
        _connector(worker=worker, settings=settings).register_kv_caches(_lbhnc()[1])
    worker.close()
