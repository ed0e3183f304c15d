"""``DefaultPageKeys``: the core's ``hicache_page_keys`` implementation, registered in every store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import PoolError
from ..hookspecs import hookimpl
from ..paging import KeyScheme, ValidHashes
from ..types import PoolName

if TYPE_CHECKING:  # pragma: no cover
    from ..config import StorageConfig
    from ..pools import HostPool

__all__ = ["DefaultPageKeys"]


class DefaultPageKeys:
    """Keys from :class:`~hicache_core.KeyScheme`, one prefix per pool component (``trylast``:
    a backend that implements ``hicache_page_keys`` overrides it)."""

    def __init__(self, config: StorageConfig) -> None:
        self.scheme = KeyScheme(config)
        self._prefixes: dict[PoolName, tuple[str, ...]] = {}

    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> None:
        name = PoolName(pool_name)
        self._prefixes[name] = tuple(self.scheme.prefixes(name, pool.components, pool.rank_replicated))

    @hookimpl(trylast=True)
    def hicache_page_keys(self, pool_name: PoolName, page_hashes: Sequence[str]) -> list[tuple[str, ...]]:
        try:
            prefixes = self._prefixes[pool_name]
        except KeyError:
            raise PoolError(
                f"pool {str(pool_name)!r} is not registered with this store; registered pools: "
                f"{[p.value for p in self._prefixes]}. Attach it through CacheController (or "
                "store.register_pool) before doing I/O on it"
            ) from None
        # the controller's batches are ValidHashes already: checked when its request was built
        hashes = page_hashes if type(page_hashes) is ValidHashes else ValidHashes(page_hashes)
        if len(prefixes) == 1:  # MLA KV, indexer
            (p0,) = prefixes
            return [(p0 + h,) for h in hashes]
        if len(prefixes) == 2:  # MHA KV: k and v
            p0, p1 = prefixes
            return [(p0 + h, p1 + h) for h in hashes]
        return list(zip(*[[p + h for h in hashes] for p in prefixes]))
