"""SGLang's own ``HiCacheFile`` and the adapter agree on hit counts for the same operations.

Both backends are created by SGLang's ``StorageBackendFactory`` (``"file"`` and ``"dynamic"``),
share the same host pools and receive the same calls with the same page hashes and host pages.
Every hit count they report (``batch_exists``, ``batch_exists_v2`` under both hit policies,
per-page get results, ``exists``) must be identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_helpers import ADAPTER_LOADER, create, sglang_config
from sglang_pools import MambaHost, MHAHost, MLAHost, fill_random

from hicache_core import page_hashes

PAGE = 4


def _idx(pages: list[int], page_size: int = PAGE) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(torch.int64)


def _result(r: Any) -> tuple[int, dict[str, int], list[int]]:
    return (
        r.kv_hit_pages,
        {str(k): v for k, v in r.extra_pool_hit_pages.items()},
        list(r.restorable_prefix_pages),
    )


def _run(backend: Any, kv: Any, keys: list[str], missing: str) -> list[Any]:
    """The operation sequence; returns every observation."""
    seen: list[Any] = [("exists0", backend.batch_exists(keys))]
    pages = [3, 1, 4, 0, 5, 2, 6, 7]
    seen.append(("set_legacy", backend.batch_set(keys[:3], [kv.get_data_page(p * PAGE) for p in pages[:3]])))
    seen.append(("exists1", backend.batch_exists(keys)))
    seen.append(
        (
            "set_v2_kv",
            backend.batch_set_v2(
                [PoolTransfer(name=PoolName.KV, host_indices=_idx(pages[3:6]), keys=keys[3:6])]
            ),
        )
    )
    for slot, key in ((1, keys[5]), (2, keys[2]), (3, keys[1])):
        t = PoolTransfer(
            name=PoolName.MAMBA,
            host_indices=torch.tensor([slot]),
            keys=[key],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
        seen.append(("set_v2_mamba", backend.batch_set_v2([t])))
    seen.append(
        (
            "set_v2_indexer",
            backend.batch_set_v2(
                [PoolTransfer(name=PoolName.INDEXER, host_indices=_idx(pages[:4]), keys=keys[:4])]
            ),
        )
    )
    seen.append(("exists2", backend.batch_exists(keys)))

    def trailing(n: int) -> PoolTransfer:
        return PoolTransfer(name=PoolName.MAMBA, keys=keys[:n], hit_policy=PoolHitPolicy.TRAILING_PAGES)

    indexer = PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    for label, probe, transfers in (
        ("v2_trailing1", keys, [trailing(1)]),
        ("v2_trailing2", keys, [trailing(2)]),
        ("v2_indexer", keys, [indexer]),
        ("v2_both", keys, [indexer, trailing(1)]),
        ("v2_short", keys[:3], [trailing(1)]),
        ("v2_none", keys, []),
        ("v2_miss_first", [missing, *keys], [trailing(1)]),
    ):
        seen.append((label, _result(backend.batch_exists_v2(probe, transfers))))
    dummies = [kv.get_dummy_flat_data_page() for _ in range(4)]
    got = backend.batch_get([keys[0], keys[4], missing, keys[2]], dummies)
    seen.append(("get_legacy", [g is not None for g in got]))
    flags = backend.batch_get_v2(
        [
            PoolTransfer(
                name=PoolName.KV, host_indices=_idx([8, 9, 10, 11]), keys=[keys[5], missing, keys[0], keys[7]]
            )
        ]
    )
    seen.append(("get_v2", {str(k): v for k, v in flags.items()}))
    seen.append(("exists_keys", [backend.exists(k) for k in (keys[4], missing, keys[6])]))
    backend.clear()
    seen.append(("exists_after_clear", backend.batch_exists(keys)))
    return seen


def test_hicachefile_and_adapter_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    kv = MHAHost(12, PAGE, layer_num=2, head_num=2, head_dim=8)
    mamba = MambaHost(6, num_layers=2)
    indexer = MLAHost(12, PAGE, layer_num=2, kv_cache_dim=8)
    for i, pool in enumerate((kv, mamba, indexer)):
        fill_random(pool, 100 + i)
    tokens = list(range(1000, 1000 + 8 * PAGE))
    keys = page_hashes(tokens, PAGE)
    missing = page_hashes([1, 2, 3, 4], PAGE)[0]
    side = {PoolName.MAMBA: mamba, PoolName.INDEXER: indexer}

    reference = _run(_file_backend(tmp_path / "sglang-file", kv, side), kv, keys, missing)
    adapter = create(
        {**ADAPTER_LOADER, "hicache_backend": "file", "hicache_options": {"root": str(tmp_path / "hicache")}},
        kv,
        pools=side,
        model="parity/model",
    )
    try:
        ours = _run(adapter, kv, keys, missing)
    finally:
        adapter.close()
    assert ours == reference
    # The sequence exercises real differences: a hole, both hit policies, misses.
    got = dict(reference)
    assert got["exists2"] == 6 and got["v2_trailing1"] == (6, {"kv": 6, "mamba": 6}, [2, 3, 6])
    assert got["v2_indexer"][0] == 4 and got["v2_miss_first"][0] == 0


def _file_backend(tmp: Path, kv: Any, side: dict[Any, Any]) -> HiCacheFile:
    """SGLang's built-in ``file`` backend, attached as the hybrid controller attaches it."""
    cfg = sglang_config({"file_storage_path": str(tmp)}, model="parity/model")
    backend = StorageBackendFactory.create_backend("file", cfg, kv)
    assert isinstance(backend, HiCacheFile)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    for name, pool in side.items():
        backend.register_mem_host_pool_v2(pool, name)
    return backend
