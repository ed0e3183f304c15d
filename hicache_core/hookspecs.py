"""The hicache hook specifications (pluggy project ``"hicache"``).

A backend is a class whose instance is registered, once per opened store, in a per-store
:class:`pluggy.PluginManager` together with any enabled extensions and the core's default
key scheme. Implement hooks as methods decorated with :data:`hookimpl`; pluggy passes
arguments by name, so a method may accept a subset of a spec's arguments (a misspelled
hook or argument name is refused when the backend is loaded).

General rules that hold for every I/O hook:

* Results are positional: result ``i`` answers key/page ``i``, whatever the order of the keys,
  host indices and transfers, and when a key or page repeats in a GET or EXISTS batch (each
  buffer gets the bytes). A result list always has exactly one entry per input, and an
  implementation never returns ``None`` for an I/O hook it implements (the store rejects both
  as a :class:`BackendContractError`).
* An empty batch is legal and must return an empty list without touching storage.
* Partial failure is reported per entry (``False``); raise only for failures that affect
  the whole call (connection lost, invalid input). The controller turns an exception into
  "every page of this call failed" and logs it with the plugin's name.
* ``True`` for ``get`` means the destination buffer now holds exactly the bytes stored by
  a successful ``set`` of the same key; never report a page that was not fully read.
* ``set`` must be atomic per key: a reader either sees the complete old state (absent) or
  the complete new page, never a torn one. ``True`` means published: a persistent backend
  keeps the page even if the writing process ends without closing its store, and a shared one
  shows it to every other store on the same options.
* CONTRIBUTING.md numbers every rule of this contract (R1, R2, ...); the conformance suite
  (:mod:`hicache_core.testing`) has tests for each.
* Buffers are lent for the call only: never keep a reference to one or touch it after the
  hook returns. When the store is staged (``io_timeout_s`` or the ``timeout`` prefetch policy,
  ARCHITECTURE.md "Ownership of host memory"), v1 buffers are the call's own staging memory,
  so a call the controller abandoned can finish late without touching the caller's pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

from .types import DraftIo, IoOp, PoolName, PoolTransfer

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .pools import HostPool

__all__ = [
    "PROJECT_NAME",
    "hicache_alloc_host_memory",
    "hicache_batch_io_v1",
    "hicache_batch_io_v2",
    "hicache_clear",
    "hicache_close",
    "hicache_draft_io_capability",
    "hicache_page_keys",
    "hicache_register_pool",
    "hookimpl",
    "hookspec",
]

PROJECT_NAME = "hicache"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marker for hicache hook specifications."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for hicache hook implementations (``@hookimpl`` or ``@hookimpl(wrapper=True)``)."""


@hookspec
def hicache_register_pool(pool_name: PoolName, pool: HostPool) -> None:
    """A host pool becomes available to the store.

    Called once per pool when a controller attaches, before any I/O hook for that pool.
    Every implementation is called (not ``firstresult``). Zero-copy backends register the
    pool's buffers (``pool.buffers()``) with their transport here; others may record sizes.

    Edge cases: registering the same ``pool_name`` twice replaces the earlier pool (a
    backend must release what it registered for it). A backend that cannot store this pool
    raises :class:`hicache_core.PoolError` naming the pools it supports.
    """
    raise NotImplementedError  # pragma: no cover - a specification, never called


@hookspec(firstresult=True)
def hicache_page_keys(pool_name: PoolName, page_hashes: Sequence[str]) -> list[tuple[str, ...]]:
    """Return the storage keys of each page's components, one tuple per page hash.

    The tuple order matches ``pool.components`` (for example ``("k", "v")`` for MHA KV).
    The core ships the default scheme (namespaced by model, KV dtype, layout, pool,
    component and rank; see :class:`hicache_core.KeyScheme`) as a ``trylast`` implementation; a
    backend may override it by implementing this hook. Keys must be safe as file names.

    Edge cases: an empty ``page_hashes`` returns ``[]``. An unregistered ``pool_name``
    raises :class:`hicache_core.PoolError`; a malformed page hash raises
    :class:`hicache_core.KeyFormatError`. Never returns ``None``.
    """
    raise NotImplementedError  # pragma: no cover - a specification, never called


@hookspec(firstresult=True)
def hicache_batch_io_v1(
    op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
) -> list[bool]:
    """The generic copy path: one object per key, one bool per key.

    ``op`` is :class:`IoOp` ``EXISTS``, ``GET`` or ``SET``. ``keys`` are component keys as
    produced by ``hicache_page_keys`` for the pool named ``pool_name`` (every key and buffer of
    one call belongs to that one pool). ``buffers`` is ``None`` for ``EXISTS``; for ``GET`` and
    ``SET`` it has one ``torch.uint8`` CPU tensor per key: a view of one page component in that
    host pool (it may be non-contiguous for ``layer_first`` pools). ``GET`` fills the view in
    place; ``SET`` reads it. A stored object whose size differs from the buffer is a miss
    (``False``). After ``False`` the buffer's content is unspecified (a backend may read in
    place), and the controller never reports that page as loaded.

    ``pool_name`` may be left out of an implementation's signature (pluggy passes arguments by
    name), so implementations that do not take it keep working.

    Returns one bool per key: ``EXISTS`` -> the object is present and readable; ``GET`` ->
    the buffer now holds the object's bytes; ``SET`` -> the object is durably published (an
    already-present key may be skipped and reported ``True``). Empty ``keys`` -> ``[]``.
    Mismatched ``len(keys)``/``len(buffers)`` -> :class:`hicache_core.BatchShapeError`.
    Never returns ``None``.
    """
    raise NotImplementedError  # pragma: no cover - a specification, never called


@hookspec(firstresult=True)
def hicache_batch_io_v2(op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
    """The multi-pool path: one list of per-page bools per :class:`PoolTransfer`.

    Each transfer names a registered pool, the host page indices, the page hashes, the hit
    policy and the resolved component keys (``transfer.keys``). Zero-copy backends move
    bytes directly between storage and ``pool.page_meta(...)`` addresses.

    Returns ``results[t][i]`` for page ``i`` of transfer ``t``: ``EXISTS`` -> every
    component of the page is present; ``GET`` -> every component was read in full; ``SET``
    -> every component is published (pages already present may be skipped and reported
    ``True``). The controller applies hit policies; the backend reports raw per-page facts.
    Empty ``transfers`` -> ``[]``; a transfer with no pages -> ``[]`` in its slot. An
    unregistered pool -> :class:`hicache_core.PoolError`. Never returns ``None``.
    """
    raise NotImplementedError  # pragma: no cover - a specification, never called


@hookspec(firstresult=True)
def hicache_draft_io_capability() -> DraftIo:
    """How this store can offload speculative-decoding draft KV, with a reason.

    ``ZERO_COPY_V2``: the controller registers the draft pool as ``PoolName.DRAFT`` and
    moves draft pages with v2 alongside the target pages. ``GENERIC``: draft pages go through
    v1 under their own keys. ``UNSUPPORTED``: draft offload is disabled with one warning that
    quotes ``reason``. May depend on the config (``should_split_heads`` turns zero-copy v2
    off). Never returns ``None``.
    """
    raise NotImplementedError  # pragma: no cover - a specification, never called


@hookspec(firstresult=True)
def hicache_alloc_host_memory(nbytes: int) -> torch.Tensor | None:
    """Provide ``nbytes`` of host memory for pools, as a flat ``torch.uint8`` CPU tensor.

    Optional. Implement it when the store must own pool memory (Mooncake standalone mode
    registers only memory from its shared pool). The controller calls it once, with the
    total size of every unallocated pool (:func:`hicache_core.sizing.standalone_required_bytes`),
    and carves the pools out of the result. Returning ``None`` (or not implementing the hook)
    means "use plain torch memory". A result of the wrong size or dtype is refused.
    """
    raise NotImplementedError  # pragma: no cover - a specification, never called


@hookspec(firstresult=True)
def hicache_clear(namespace: str) -> int:
    """Remove every stored object whose key starts with ``namespace + "."``; return how many.

    Optional. ``namespace`` is passed without the trailing dot (keys are
    ``{namespace}.{pool}.{component}.{ranks}.{hash}``); match on ``namespace + "."`` so that a
    namespace that is a string prefix of another keeps the other's data. Only this namespace is
    affected: other models, dtypes or ranks sharing the same storage keep their data. Returns an
    ``int`` >= 0; ``None`` is refused as a contract error.
    """
    raise NotImplementedError  # pragma: no cover - a specification, never called


@hookspec
def hicache_close() -> None:
    """The store is closing: release connections, registered memory and threads.

    Optional. Called once; every implementation is called. Must not raise for an already
    broken connection.
    """
