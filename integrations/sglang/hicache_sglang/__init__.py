"""hicache-sglang: every hicache backend as an SGLang HiCache storage backend.

Load it through SGLang's ``dynamic`` storage backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache", "module_path": "hicache_sglang",
        "class_name": "HiCacheAdapter", "interface_v1": 1, "hicache_backend": "file",
        "hicache_options": {"root": "/var/cache/hicache"}}'

Importing this package imports SGLang (``sglang.srt.mem_cache.hicache_storage``).
"""

from __future__ import annotations

from ._config import AdapterSettings, parse_extra_config
from ._pools import SGLangPoolView, build_pool_view
from .adapter import HiCacheAdapter

__version__ = "0.1.0"

__all__ = [
    "AdapterSettings",
    "HiCacheAdapter",
    "SGLangPoolView",
    "__version__",
    "build_pool_view",
    "parse_extra_config",
]
