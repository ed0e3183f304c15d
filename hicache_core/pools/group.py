"""``HostPoolGroup``: the pools of one model, keyed by :class:`PoolName`, with KV as anchor."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..errors import ArgumentTypeError, PoolError
from ..types import PoolName
from .host import Allocator, HostPool, _checked_alloc, torch_allocator

__all__ = ["HostPoolGroup"]


class HostPoolGroup(Mapping[PoolName, HostPool]):
    """An immutable mapping ``PoolName -> HostPool`` whose ``KV`` entry is the anchor.

    ``HostPoolGroup(kv_pool, {PoolName.MAMBA: mamba, PoolName.DRAFT: draft})``. The anchor's
    host indices name pages; sidecar pools (Mamba, indexer, draft) are indexed alongside.
    """

    def __init__(self, kv: HostPool, extras: Mapping[PoolName | str, HostPool] | None = None) -> None:
        if not isinstance(kv, HostPool):
            raise PoolError(
                f"HostPoolGroup: kv needs a KV HostPool as its anchor, got {type(kv).__name__}; "
                "build one with MHAKVPool(...) or MLAKVPool(...)"
            )
        if extras is not None and not isinstance(extras, Mapping):
            raise ArgumentTypeError(
                f"HostPoolGroup: extras must be a mapping of pool name -> HostPool (e.g. "
                f"{{PoolName.MAMBA: mamba_pool}}) or None, got {type(extras).__name__}"
            )
        pools: dict[PoolName, HostPool] = {PoolName.KV: kv}
        for name, pool in (extras or {}).items():
            try:
                key = PoolName(name)
            except (ValueError, TypeError):
                raise PoolError(
                    f"unknown pool name {name!r}; known pools: {[p.value for p in PoolName]}"
                ) from None
            if key is PoolName.KV:
                raise PoolError("the KV pool is the anchor; pass it as the first argument")
            if not isinstance(pool, HostPool):
                raise PoolError(
                    f"HostPoolGroup: extras[{key.value!r}] must be a HostPool, got {type(pool).__name__}"
                )
            pools[key] = pool
        self._pools = pools

    @property
    def anchor(self) -> HostPool:
        return self._pools[PoolName.KV]

    def __getitem__(self, name: PoolName | str) -> HostPool:
        try:
            return self._pools[PoolName(name)]
        except (KeyError, ValueError, TypeError):
            raise PoolError(
                f"pool {str(name)!r} is not in this HostPoolGroup; it holds {[p.value for p in self._pools]}"
            ) from None

    def __contains__(self, name: object) -> bool:
        try:
            return PoolName(name) in self._pools
        except (ValueError, TypeError):
            return False

    def get(self, name: PoolName | str, default: HostPool | None = None) -> HostPool | None:  # type: ignore[override]
        return self._pools.get(PoolName(name), default) if name in self else default

    def __iter__(self) -> Iterator[PoolName]:
        return iter(self._pools)

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def allocated(self) -> bool:
        return all(p.allocated for p in self._pools.values())

    @property
    def unallocated_nbytes(self) -> int:
        """Bytes of one region that holds every pool not yet allocated."""
        return sum(p.nbytes for p in self._pools.values() if not p.allocated)

    def allocate(self, allocator: Allocator = torch_allocator) -> None:
        """Allocate every planned pool from ONE region taken from ``allocator``.

        One region means one registration for stores that must own the memory.
        """
        todo = [p for p in self._pools.values() if not p.allocated]
        if not todo:
            return
        total = sum(p.nbytes for p in todo)
        region = _checked_alloc(allocator, total)
        offset = 0
        for pool in todo:
            pool.bind(region[offset : offset + pool.nbytes])
            offset += pool.nbytes

    def __repr__(self) -> str:
        inner = ", ".join(f"{k.value}={v!r}" for k, v in self._pools.items())
        return f"HostPoolGroup({inner})"
