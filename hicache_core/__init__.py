"""hicache: a plugin framework for the storage (L3) layer of a tiered LLM KV cache.

This module only re-exports names. Heavy dependencies (torch, pydantic) load on first use of
the names that need them, so ``import hicache_core`` and backend listing stay fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import (
    ArgumentTypeError,
    BackendContractError,
    BackendIOError,
    BackendNotFoundError,
    BackendTimeoutError,
    BackendUnavailableError,
    BatchShapeError,
    BatchTypeError,
    ClosedError,
    ConfigError,
    HiCacheError,
    KeyFormatError,
    KeyTypeError,
    OperationNotSupportedError,
    OptionsError,
    PoolError,
)
from .hookspecs import hookimpl, hookspec
from .types import (
    Capabilities,
    DraftIo,
    DraftIoMode,
    HitPolicy,
    IoOp,
    Layout,
    PageKeys,
    PoolName,
    PoolTransfer,
)

if TYPE_CHECKING:  # pragma: no cover
    from .config import ControllerSettings, PrefetchPolicy, StorageConfig, load_config
    from .paging import KeyScheme, check_key, check_keys, check_page_hash, page_hashes
    from .plugin import (
        BACKENDS_GROUP,
        EXTENSIONS_GROUP,
        DefaultPageKeys,
        Store,
        backend_names,
        find_backends,
        load_backend_class,
        open_store,
    )
    from .pools import ComponentSpec, HostPool, HostPoolGroup, IndexerPool, MambaPool, MHAKVPool, MLAKVPool
    from .transfer import (
        CacheController,
        DraftOffloadDisabledWarning,
        PrefetchHandle,
        QueryResult,
        TransferResult,
    )

__version__ = "0.1.0"

_LAZY = {
    "ControllerSettings": "config",
    "PrefetchPolicy": "config",
    "StorageConfig": "config",
    "load_config": "config",
    "CacheController": "transfer",
    "DraftOffloadDisabledWarning": "transfer",
    "PrefetchHandle": "transfer",
    "page_hashes": "paging",
    "Backend": "plugin",
    "V1Backend": "plugin",
    "V2Backend": "plugin",
    "DefaultPageKeys": "plugin",
    "KeyScheme": "paging",
    "check_key": "paging",
    "check_keys": "paging",
    "check_page_hash": "paging",
    "HostPoolGroup": "pools",
    "ComponentSpec": "pools",
    "HostPool": "pools",
    "IndexerPool": "pools",
    "MHAKVPool": "pools",
    "MLAKVPool": "pools",
    "MambaPool": "pools",
    "BACKENDS_GROUP": "plugin",
    "EXTENSIONS_GROUP": "plugin",
    "backend_names": "plugin",
    "find_backends": "plugin",
    "load_backend_class": "plugin",
    "QueryResult": "transfer",
    "TransferResult": "transfer",
    "Store": "plugin",
    "open_store": "plugin",
}

__all__ = [
    "BACKENDS_GROUP",
    "EXTENSIONS_GROUP",
    "ArgumentTypeError",
    "Backend",
    "BackendContractError",
    "BackendIOError",
    "BackendNotFoundError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "BatchShapeError",
    "BatchTypeError",
    "CacheController",
    "Capabilities",
    "ClosedError",
    "ComponentSpec",
    "ConfigError",
    "ControllerSettings",
    "DefaultPageKeys",
    "DraftIo",
    "DraftIoMode",
    "DraftOffloadDisabledWarning",
    "HiCacheError",
    "HitPolicy",
    "HostPool",
    "HostPoolGroup",
    "IndexerPool",
    "IoOp",
    "KeyFormatError",
    "KeyScheme",
    "KeyTypeError",
    "Layout",
    "MHAKVPool",
    "MLAKVPool",
    "MambaPool",
    "OperationNotSupportedError",
    "OptionsError",
    "PageKeys",
    "PoolError",
    "PoolName",
    "PoolTransfer",
    "PrefetchHandle",
    "PrefetchPolicy",
    "QueryResult",
    "StorageConfig",
    "Store",
    "TransferResult",
    "V1Backend",
    "V2Backend",
    "__version__",
    "backend_names",
    "check_key",
    "check_keys",
    "check_page_hash",
    "find_backends",
    "hookimpl",
    "hookspec",
    "load_backend_class",
    "load_config",
    "open_store",
    "page_hashes",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_core' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
