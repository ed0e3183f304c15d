"""Results of controller operations: per-pool, per-page facts plus the usable prefix."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..types import PoolName

__all__ = ["QueryResult", "TransferResult"]


@dataclass(frozen=True)
class QueryResult:
    """How many leading pages are restorable, overall and per pool (before its hit policy)."""

    pages: int
    per_pool: dict[PoolName, int] = field(default_factory=dict)
    errors: tuple[str, ...] = ()

    def __int__(self) -> int:
        return self.pages


@dataclass(frozen=True)
class TransferResult:
    """Outcome of a backup or prefetch.

    ``pages``: leading pages fully done in every (non-draft) pool; for a prefetch, the number
    of pages the engine may use. ``per_pool[name][i]``: page ``i`` of that pool's share of the
    batch (trailing-policy pools cover only the tail). ``draft``: per-page flags of the draft
    pool, or ``None`` when draft offload is disabled. ``skipped``: pages not written because
    the existence pass found them stored, or because they belong to another rank (a backend
    declaring ``capabilities.set_skips_existing`` gets no existence pass: it skips stored pages
    itself, and those are not counted here). ``errors``: backend failures, each naming
    the plugin; they are also logged.
    """

    pages: int
    per_pool: dict[PoolName, list[bool]] = field(default_factory=dict)
    draft: list[bool] | None = None
    skipped: int = 0
    errors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Every requested page of every pool succeeded and no error was reported."""
        return not self.errors and all(all(v) for v in self.per_pool.values())

    def __int__(self) -> int:
        return self.pages
