"""Plugin loading: the entry-point registry and ``Store``, one opened backend behind pluggy.

``Store`` and what comes with it (pydantic, the config) load on first use, so listing backends
through the registry stays cheap.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .registry import (
    BACKENDS_GROUP,
    EXTENSIONS_GROUP,
    availability,
    backend_names,
    describe_backend,
    find_backends,
    find_extensions,
    load_backend_class,
    load_extension_class,
)

if TYPE_CHECKING:  # pragma: no cover
    from .default_keys import DefaultPageKeys
    from .protocol import Backend, V1Backend, V2Backend
    from .store import Store, open_store, validate_options

_LAZY = {
    "Backend": "protocol",
    "V1Backend": "protocol",
    "V2Backend": "protocol",
    "DefaultPageKeys": "default_keys",
    "Store": "store",
    "open_store": "store",
    "validate_options": "store",
}

__all__ = [
    "BACKENDS_GROUP",
    "EXTENSIONS_GROUP",
    "Backend",
    "DefaultPageKeys",
    "Store",
    "V1Backend",
    "V2Backend",
    "availability",
    "backend_names",
    "describe_backend",
    "find_backends",
    "find_extensions",
    "load_backend_class",
    "load_extension_class",
    "open_store",
    "validate_options",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
