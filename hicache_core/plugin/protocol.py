"""``Backend``: what a backend object is, as a typed description (a :class:`typing.Protocol`).

A backend is a class named by a ``hicache.backends`` entry point. The store builds one instance
per opened store as ``cls(config, options)`` and registers it in its own pluggy
``PluginManager``. The loader (``validate_backend_class``) checks the same rules at load time,
naming the plugin and the fix; these protocols let type checkers check them too.

* every backend: ``Options``, ``capabilities``, the constructor, ``hicache_register_pool`` and
  ``hicache_draft_io_capability``;
* ``capabilities.v1`` declared: also ``hicache_batch_io_v1`` (:class:`V1Backend`);
* ``capabilities.v2`` declared: also ``hicache_batch_io_v2`` (:class:`V2Backend`);
* optional, any backend: ``hicache_page_keys`` (override the default key scheme),
  ``hicache_alloc_host_memory``, ``hicache_clear``, ``hicache_close``.

Hook methods carry the :data:`hicache_core.hookimpl` marker; an implementation may take a
subset of the hookspec's arguments (pluggy passes them by name).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from ..types import Capabilities, DraftIo, IoOp, PoolName, PoolTransfer

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from pydantic import BaseModel

    from ..config import StorageConfig
    from ..pools import HostPool

__all__ = ["Backend", "V1Backend", "V2Backend"]


@runtime_checkable
class Backend(Protocol):
    """Every backend: static declarations, the constructor and the always-required hooks."""

    Options: ClassVar[type[BaseModel]]
    """A pydantic model with ``extra="forbid"`` whose fields all have defaults."""

    capabilities: Capabilities
    """Declared on the class; an instance may narrow it (never widen) for its options."""

    def __init__(self, config: StorageConfig, options: Any) -> None:
        """Open the storage named by ``options`` (an instance of ``Options``) for ``config``."""

    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> None: ...

    def hicache_draft_io_capability(self) -> DraftIo: ...


@runtime_checkable
class V1Backend(Backend, Protocol):
    """A backend declaring ``capabilities.v1``: the generic copy path, one object per key."""

    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> list[bool]: ...


@runtime_checkable
class V2Backend(Backend, Protocol):
    """A backend declaring ``capabilities.v2``: the multi-pool path, zero-copy where declared."""

    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]]: ...
