"""hicache-vllm: every hicache backend as a vLLM KV store.

Load the connector by module path (vLLM imports it in the scheduler and in every worker)::

    --kv-transfer-config '{"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache_vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": {"backend": "file",
        "options": {"root": "/var/cache/hicache"}}}'

``import hicache_vllm`` does not import vLLM: ``HiCacheConnector`` (and its metadata class) are
loaded on first access, so the package installs and imports in environments without vLLM.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._config import ConnectorSettings, PageFormat, parse_extra_config
from ._scheduler import PageOp, PageOps

if TYPE_CHECKING:  # pragma: no cover
    from .connector import HiCacheConnector, HiCacheConnectorMetadata

__version__ = "0.1.0"

__all__ = [
    "ConnectorSettings",
    "HiCacheConnector",
    "HiCacheConnectorMetadata",
    "PageFormat",
    "PageOp",
    "PageOps",
    "__version__",
    "parse_extra_config",
]

_LAZY = {"HiCacheConnector": "connector", "HiCacheConnectorMetadata": "connector"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_vllm' has no attribute {name!r}")
    try:
        loaded = import_module(f".{module}", __name__)
    except ModuleNotFoundError as err:
        if err.name is None or not err.name.startswith("vllm"):
            raise
        raise ModuleNotFoundError(
            f"hicache_vllm.{name} needs vLLM, which is not installed in this environment "
            f"({err}); install the connector into vLLM's environment: pip install hicache-vllm",
            name=err.name,
        ) from err
    value = getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
