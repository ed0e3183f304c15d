"""hicache-hf3fs-stub: the ``hf3fs`` backend (3FS-usrbio-style slot files, working) and the
SDK-gated ``eic`` and ``simm`` declarations (``nixl`` is its own distribution,
``hicache-nixl``).

Entry points (group ``hicache.backends``) name the classes in their modules directly, so
listing backends imports only what it describes. The names below are re-exported lazily.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .hf3fs import Hf3fsBackend
    from .vendor import EicBackend, SimmBackend, VendorSdkBackend

__version__ = "0.1.0"
__all__ = ["EicBackend", "Hf3fsBackend", "SimmBackend", "VendorSdkBackend", "__version__"]

_LAZY = {
    "Hf3fsBackend": "hf3fs",
    "EicBackend": "vendor",
    "SimmBackend": "vendor",
    "VendorSdkBackend": "vendor",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_hf3fs_stub' has no attribute {name!r}")
    return getattr(import_module(f".{module}", __name__), name)
