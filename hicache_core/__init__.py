"""hicache: a plugin framework for the storage (L3) layer of a tiered LLM KV cache.

This module only re-exports names. Heavy dependencies (torch, pydantic) load on first use of
the names that need them, so ``import hicache_core`` and backend listing stay fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._errors import (
    BackendContractError,
    BackendIOError,
    BackendNotFoundError,
    BackendTimeoutError,
    BackendUnavailableError,
    BatchShapeError,
    ConfigError,
    HiCacheError,
    KeyFormatError,
    OperationNotSupportedError,
    OptionsError,
    PoolError,
)
from ._types import Capabilities, DraftIo, DraftIoMode, HitPolicy, IoOp, Layout, PoolName, PoolTransfer
from .hookspecs import hookimpl, hookspec

if TYPE_CHECKING:  # pragma: no cover
    from ._config import ControllerSettings, PrefetchPolicy, StorageConfig, load_config
    from ._controller import CacheController, DraftOffloadDisabledWarning
    from ._hashing import page_hashes
    from ._keys import DefaultPageKeys, KeyScheme, check_key, check_keys, check_page_hash
    from ._pool_group import HostPoolGroup
    from ._pools import ComponentSpec, HostPool, IndexerPool, MambaPool, MHAKVPool, MLAKVPool
    from ._prefetch import PrefetchHandle
    from ._registry import BACKENDS_GROUP, EXTENSIONS_GROUP, backend_names, find_backends, load_backend_class
    from ._results import QueryResult, TransferResult
    from ._store import Store, open_store

__version__ = "0.1.0"

_LAZY = {
    "ControllerSettings": "_config",
    "PrefetchPolicy": "_config",
    "StorageConfig": "_config",
    "load_config": "_config",
    "CacheController": "_controller",
    "DraftOffloadDisabledWarning": "_controller",
    "PrefetchHandle": "_prefetch",
    "page_hashes": "_hashing",
    "DefaultPageKeys": "_keys",
    "KeyScheme": "_keys",
    "check_key": "_keys",
    "check_keys": "_keys",
    "check_page_hash": "_keys",
    "HostPoolGroup": "_pool_group",
    "ComponentSpec": "_pools",
    "HostPool": "_pools",
    "IndexerPool": "_pools",
    "MHAKVPool": "_pools",
    "MLAKVPool": "_pools",
    "MambaPool": "_pools",
    "BACKENDS_GROUP": "_registry",
    "EXTENSIONS_GROUP": "_registry",
    "backend_names": "_registry",
    "find_backends": "_registry",
    "load_backend_class": "_registry",
    "QueryResult": "_results",
    "TransferResult": "_results",
    "Store": "_store",
    "open_store": "_store",
}

__all__ = [
    "BACKENDS_GROUP",
    "EXTENSIONS_GROUP",
    "BackendContractError",
    "BackendIOError",
    "BackendNotFoundError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "BatchShapeError",
    "CacheController",
    "Capabilities",
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
    "Layout",
    "MHAKVPool",
    "MLAKVPool",
    "MambaPool",
    "OperationNotSupportedError",
    "OptionsError",
    "PoolError",
    "PoolName",
    "PoolTransfer",
    "PrefetchHandle",
    "PrefetchPolicy",
    "QueryResult",
    "StorageConfig",
    "Store",
    "TransferResult",
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
