"""Request planning for ``CacheController``: which pages of which pool move, and their bookkeeping.

A :class:`Plan` is one pool's share of a request: ascending page positions (indices into the
request's page hashes) and the host pages that hold them. The helpers here are pure: they
split plans into batches, record per-page outcomes and compute usable prefixes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import compress
from operator import not_
from typing import Any

from ..errors import ArgumentTypeError, BatchShapeError, PoolError
from ..pools import HostPool, HostPoolGroup
from ..types import HitPolicy, PoolName

__all__ = [
    "IndexLike",
    "Plan",
    "Planner",
    "chunks",
    "leading_run",
    "restorable",
    "usable",
]

IndexLike = Sequence[int] | Any
_ALL_PAGES = HitPolicy.ALL_PAGES  # an enum member lookup costs a Python call (Python 3.11)
_KV = PoolName.KV


class Plan:
    """One pool's share of a request: page positions (ascending; a ``range`` when they are a run)
    and the host pages that hold them.

    Plans are never mutated after construction; identity, not value, tells them apart.
    """

    __slots__ = ("indices", "name", "pool", "positions")

    def __init__(self, name: PoolName, pool: HostPool, positions: Sequence[int], indices: list[int]) -> None:
        self.name = name
        self.pool = pool
        self.positions = positions
        self.indices = indices

    def window(self, start: int, stop: int) -> Plan:
        """The part of this plan whose positions fall in ``[start, stop)``."""
        pos = self.positions
        if not pos or (pos[0] >= start and pos[-1] < stop):
            return self
        lo, hi = bisect_left(pos, start), bisect_left(pos, stop)
        return Plan(self.name, self.pool, pos[lo:hi], self.indices[lo:hi])

    def missing(self, found: Sequence[bool]) -> Plan | None:
        """The part of this plan whose entry in ``found`` is falsy (``None`` if there is none)."""
        if len(found) == len(self.positions):
            if not any(found):
                return self if found else None
            if all(found):
                return None
            keep = list(map(not_, found))
            return Plan(
                self.name, self.pool, [*compress(self.positions, keep)], [*compress(self.indices, keep)]
            )
        sel = [i for i, e in enumerate(found) if not e]
        if not sel:
            return None
        return Plan(self.name, self.pool, [self.positions[i] for i in sel], [self.indices[i] for i in sel])

    def __repr__(self) -> str:
        return f"Plan({self.name.value}, positions={self.positions}, indices={self.indices})"


class Planner:
    """Plans the requests of one pool group: its KV anchor and sidecar pools are looked up once
    (when the controller attaches), not per request."""

    __slots__ = ("anchor", "pools", "sidecars")

    def __init__(self, pools: HostPoolGroup) -> None:
        self.pools = pools
        self.anchor = pools.anchor
        self.sidecars = [(name, pool) for name, pool in pools.items() if name is not PoolName.KV]

    def plan(
        self,
        n: int,
        host_indices: IndexLike,
        extra: Mapping[PoolName | str, IndexLike] | None,
        draft_enabled: bool,
        load: bool = False,
    ) -> tuple[list[Plan], Plan | None]:
        """Validate a request's host indices; return the target plans (KV first) and the draft plan.

        ``load``: the pages are read into the slots, so no slot may appear twice in a pool (two
        pages cannot both be in one slot, and only one of them would be reported truthfully)."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ArgumentTypeError(
                "extra must be a mapping of pool name -> host indices (e.g. {'mamba': [3]}) or None, "
                f"got {type(extra).__name__}"
            )
        anchor = self.anchor
        kv_idx = anchor.check_indices(host_indices)
        if len(kv_idx) != n:
            raise BatchShapeError(
                f"{len(kv_idx)} KV host indices for {n} page hashes; pass one host page per page hash"
            )
        if load:
            _distinct(kv_idx, _KV)
        plans = [Plan(_KV, anchor, range(n), kv_idx)]
        if not extra and not self.sidecars:  # the usual request: the KV pool alone
            return plans, None
        pools = self.pools
        given: dict[PoolName, IndexLike] = {}
        for name, idx in (extra or {}).items():
            try:
                pool_name = PoolName(name)
            except ValueError:
                raise PoolError(
                    f"unknown pool name {name!r}; known pools: {[p.value for p in PoolName]}"
                ) from None
            if pool_name not in pools or pool_name is PoolName.KV:
                raise PoolError(
                    f"extra indices for pool {str(name)!r}, which is not a sidecar pool of this group "
                    f"({[p.value for p in pools if p is not PoolName.KV]})"
                )
            given[pool_name] = idx
        draft: Plan | None = None
        for name, pool in self.sidecars:
            if name in given:
                idx = pool.check_indices(given[name])
            elif pool.hit_policy is HitPolicy.ALL_PAGES:
                idx = pool.check_indices(kv_idx)  # sidecars share the KV page slots by default
            else:
                continue  # trailing-state pools move only when their slots are given
            if pool.hit_policy is HitPolicy.TRAILING_PAGES:
                if len(idx) > n:
                    raise BatchShapeError(
                        f"{len(idx)} host slots for trailing pool {name.value!r} but only {n} pages"
                    )
                positions = range(n - len(idx), n)
            else:
                if len(idx) != n:
                    raise BatchShapeError(f"{len(idx)} host indices for pool {name.value!r}, expected {n}")
                positions = range(n)
            if load and name in given:  # (slots shared with KV were checked with KV's)
                _distinct(idx, name)
            plan = Plan(name, pool, positions, idx)
            if name is PoolName.DRAFT:
                draft = plan if draft_enabled else None
            else:
                plans.append(plan)
        return plans, draft


def _distinct(indices: list[int], name: PoolName) -> None:
    if len(set(indices)) != len(indices):
        twice = next(i for i in indices if indices.count(i) > 1)
        raise BatchShapeError(
            f"host slot {twice} appears twice in the {name.value!r} indices of a load; give each "
            "page its own slot"
        )


def chunks(n: int, step: int) -> list[tuple[int, int]]:
    """``[0, n)`` in batches of ``step`` positions."""
    if n <= step:
        return [(0, n)] if n else []
    return [(s, min(s + step, n)) for s in range(0, n, step)]


def leading_run(flags: Sequence[bool]) -> int:
    """Length of the leading run of true entries (the prefix length, since page hashes chain)."""
    if all(flags):
        return len(flags)
    return list(map(bool, flags)).index(False)


def usable(plans: list[Plan], flags: Mapping[PoolName, list[bool]], n: int, *, anchored: bool = False) -> int:
    """Leading pages done in every pool under its hit policy.

    A trailing pool must have all its pages done, else nothing is resumable. ``anchored`` (a
    restore): its state must also belong to exactly the last usable page, so when an all-pages
    pool stops short of the trailing pool's last page, nothing is usable.
    """
    pages = n
    trailing = False
    for p in plans:
        if p.pool.hit_policy is _ALL_PAGES:
            f = flags[p.name]
            pages = min(pages, len(f) if all(f) else f.index(False))
        else:
            trailing = True
    if trailing:
        for p in plans:
            if p.pool.hit_policy is not _ALL_PAGES:
                if not all(flags[p.name]) or (anchored and p.positions and p.positions[-1] + 1 != pages):
                    return 0  # the state at the end of the prefix is missing or belongs elsewhere
    return pages


def restorable(
    plans: list[Plan], found: Mapping[PoolName, list[bool]], window: int
) -> tuple[int, dict[PoolName, int]]:
    """Restorable leading pages (overall and per pool) from per-page existence."""
    per_pool: dict[PoolName, int] = {}
    run = len(next(iter(found.values()))) if found else 0
    for p in plans:
        if p.pool.hit_policy is HitPolicy.ALL_PAGES:
            per_pool[p.name] = leading_run(found[p.name])
            run = min(run, per_pool[p.name])
    pages = run
    for p in plans:
        if p.pool.hit_policy is HitPolicy.TRAILING_PAGES:
            f, best = found[p.name], 0
            for m in range(run, 0, -1):
                if all(f[max(0, m - window) : m]):
                    best = m
                    break
            per_pool[p.name] = best
            pages = min(pages, best)
    return pages, per_pool
