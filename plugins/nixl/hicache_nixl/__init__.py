"""hicache backend over NVIDIA NIXL: pages as files (POSIX plugin) or S3 objects (OBJ plugin).

The entry point ``nixl = "hicache_nixl:NixlBackend"`` (group ``hicache.backends``) names
:class:`~hicache_nixl._backend.NixlBackend`. Importing this package is cheap: the backend
module loads on first attribute access, and NIXL itself only when a store is opened.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ._backend import NixlBackend
    from ._options import NixlOptions

__version__ = "0.1.0"
__all__ = ["NixlBackend", "NixlOptions", "__version__"]

_LAZY = {"NixlBackend": "._backend", "NixlOptions": "._options"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_nixl' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value
