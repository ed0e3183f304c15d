"""hicache backend on the real Mooncake distributed store (``mooncake-transfer-engine``).

The entry point ``mooncake = "hicache_mooncake:MooncakeBackend"`` (group ``hicache.backends``)
names :class:`~hicache_mooncake.backend.MooncakeBackend`. Importing this package is cheap: the
backend module (and with it pydantic and ``hicache_core``) loads on first attribute access, and
``mooncake.store`` only when a store is opened. Test fixtures live in
:mod:`hicache_mooncake.testing`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ._connection import close_idle_connections
    from ._options import MooncakeOptions
    from .backend import MooncakeBackend

__version__ = "0.1.0"
__all__ = ["MooncakeBackend", "MooncakeOptions", "__version__", "close_idle_connections"]

_LAZY = {
    "MooncakeBackend": ".backend",
    "MooncakeOptions": "._options",
    "close_idle_connections": "._connection",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_mooncake' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value
