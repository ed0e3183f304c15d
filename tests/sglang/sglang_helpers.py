"""Helpers shared by the SGLang integration tests (imported by name; kept out of conftest.py).

Every adapter is created the way SGLang creates it: ``StorageBackendFactory.create_backend(
"dynamic", HiCacheStorageConfig(...), host_pool)`` followed by ``register_mem_pool_host`` (and,
for hybrid models, ``register_mem_host_pool_v2`` per pool), as ``HiCacheController`` and
``HybridCacheController.attach_storage_backend`` do.
"""

from __future__ import annotations

from typing import Any

from hicache_sglang.testing import ADAPTER_LOADER, sglang_config
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

__all__ = ["ADAPTER_LOADER", "create", "sglang_config"]


def create(
    extra_config: dict[str, Any], kv_pool: Any, *, pools: dict[Any, Any] | None = None, **config: Any
) -> Any:
    """Create and attach a backend exactly as SGLang's controllers do."""
    cfg = sglang_config(extra_config, page_first=kv_pool.layout == "page_first", **config)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, kv_pool)
    backend.register_mem_pool_host(kv_pool)
    if pools:
        backend.register_mem_host_pool_v2(kv_pool, PoolName.KV)
        for name, pool in pools.items():
            backend.register_mem_host_pool_v2(pool, name)
        backend.on_host_pools_registered()
    return backend
