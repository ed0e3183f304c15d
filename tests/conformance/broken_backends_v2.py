"""Broken examples with a defect on the v2 path only (each declares v1 AND v2; v1 stays correct).

The controller picks v2 when a backend declares both, while raw checks (re-set, exact bytes,
size mismatch, clear) can be run on either path: these examples prove that the suite checks the
v2 path of such a backend as hard as its v1 path. See ``broken_backends.py`` for the registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache_core import HitPolicy, IoOp, PoolName, PoolTransfer, hookimpl

from .broken_backends import LOCK, GoodMemory, as_bytes, copy_into, copy_what_fits


class V2StaleReadCache(GoodMemory):
    """v2 GET serves pages from a per-store read cache that nothing invalidates (v1 is correct):
    after ``clear()`` or an overwrite, v2 GET still returns the old bytes (or a hit for a page
    that is gone) while v1 GET returns what is stored.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "`GET` the buffer now holds the stored
    bytes", and ``hicache_clear``: "Remove every object whose key starts with `namespace + "."`".
    """

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.v2_cache: dict[str, bytes] = {}

    def page_io(self, op: IoOp, keys: Sequence[str], views: Sequence[torch.Tensor] | None) -> bool:
        if op is not IoOp.GET:
            return super().page_io(op, keys, views)
        assert views is not None
        for key, view in zip(keys, views):
            blob = self.v2_cache.get(key)
            if blob is None:
                with LOCK:
                    blob = self.data.get(key)
                if blob is None or len(blob) != view.numel():
                    return False
                self.v2_cache[key] = blob
            copy_into(view, blob)
        return True


class V2ResetMixes(GoodMemory):
    """v2 SET of an existing key overwrites only its first half; v1 SET replaces it whole.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v2``: "A page is `True` only when every
    component is present / read / published" and ``hicache_batch_io_v1``: "`SET` durably and
    atomically published"; the template: "readers see the old state or the whole page".
    """

    def page_io(self, op: IoOp, keys: Sequence[str], views: Sequence[torch.Tensor] | None) -> bool:
        if op is not IoOp.SET:
            return super().page_io(op, keys, views)
        assert views is not None
        with LOCK:
            for key, view in zip(keys, views):
                new, old = as_bytes(view), self.data.get(key)
                half = len(new) // 2
                self.data[key] = new if old is None or len(old) != len(new) else new[:half] + old[half:]
        return True


class V2PartialCopyOnSizeMismatch(GoodMemory):
    """v2 GET of an object whose stored size differs from the pool component copies what fits
    and reports the page ``True`` (v1 reports the mismatch as a miss).

    Breaks: CONTRIBUTING.md 1.4: "a stored object of another size is `False`; after `False` the
    buffer's content is unspecified, and the page is never reported loaded"; the template: "a
    size mismatch is a miss, never a partial copy".
    """

    def page_io(self, op: IoOp, keys: Sequence[str], views: Sequence[torch.Tensor] | None) -> bool:
        if op is not IoOp.GET:
            return super().page_io(op, keys, views)
        assert views is not None
        with LOCK:
            for key, view in zip(keys, views):
                blob = self.data.get(key)
                if blob is None:
                    return False
                copy_what_fits(view, blob)
        return True


class V2ZeroesSpan(GoodMemory):
    """v2 GET stages a transfer as one contiguous span: it zeroes every host page between the
    lowest and the highest index asked for, then copies the pages asked for, so the host pages in
    between that were not asked for are overwritten with zeros.

    Breaks: design.md 8 / the ``bytes`` group: "exact bytes after get; get writes only its own
    destination"; CONTRIBUTING.md 1.4: a ``PoolTransfer`` names the pages (``host_indices``) to
    move.
    """

    def transfer_io(self, op: IoOp, t: PoolTransfer) -> list[bool]:
        if op is IoOp.GET:
            pool = self.pools[t.pool]
            span = range(min(t.host_indices), max(t.host_indices) + 1)
            for views in pool.page_views(span):
                for view in views:
                    view.zero_()
        return super().transfer_io(op, t)


class V2AnyComponent(GoodMemory):
    """v2 reports a page ``True`` when ANY of its components succeeded (exists, get or set),
    so a page with a missing ``v`` is reported present and loaded.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v2``: "A page is `True` only when every
    component is present / read / published."
    """

    def page_io(self, op: IoOp, keys: Sequence[str], views: Sequence[torch.Tensor] | None) -> bool:
        return any(self.io(op, keys, views) or [])


class KeepsFirstPool(GoodMemory):
    """Registering a pool again under the same ``PoolName`` is ignored: v2 keeps reading into
    and writing from the first pool object (v1 gets its buffers per call and is unaffected).

    Breaks: CONTRIBUTING.md 1.4, ``hicache_register_pool``: "Registering a name again replaces the
    earlier pool (release what you registered for it)."
    """

    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: Any) -> None:
        self.pools.setdefault(pool_name, pool)


class AppliesTrailingPolicy(GoodMemory):
    """v2 EXISTS applies the trailing-pages hit policy itself: once the last page of a
    ``trailing_pages`` transfer (Mamba state) is present, every page of it is reported present.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v2``: "Report raw per-page facts (the
    controller applies hit policies)."
    """

    def transfer_io(self, op: IoOp, t: PoolTransfer) -> list[bool]:
        flags = super().transfer_io(op, t)
        if op is IoOp.EXISTS and t.hit_policy is HitPolicy.TRAILING_PAGES and flags and flags[-1]:
            return [True] * len(flags)
        return flags


class DropsEmptyTransfers(GoodMemory):
    """v2 leaves a transfer with no pages out of its result instead of giving it ``[]``.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v2``: "One list of per-page bools per
    `PoolTransfer`" and "a transfer with no pages gets `[]` in its slot".
    """

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]] | None:
        return [self.transfer_io(op, t) for t in transfers if len(t)]
