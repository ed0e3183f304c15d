"""``TransferPath``: the one place where pages move between host pools and the store.

Every batch of every operation goes through here, whatever its size, for the controller and
for every engine adapter alike:

* :meth:`TransferPath.io` makes one storage call for a batch of :class:`~.plan.Plan` s: v2 (one
  ``PoolTransfer`` per pool, one call) or v1 (one call per pool, naming it, with a page done
  when all its components are). A failing or timed-out call reports every page of it failed and
  records the error; it never raises.
* :meth:`exists`, :meth:`put` and :meth:`get` split a request into batches of ``batch_pages``
  and apply the rules every caller needs: rank-replicated pools are written by rank 0 only, a
  put skips stored pages (with an existence pass unless the backend declares
  ``set_skips_existing``), a get can stop after the first batch with a miss.

The v1 / v2 choice is made once by whoever builds the path, from the declared capabilities.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Literal, TypeVar

import torch

from ..errors import BackendTimeoutError, HiCacheError
from ..paging import ValidHashes
from ..plugin import Store
from ..types import Capabilities, HitPolicy, IoOp, Layout, PoolName, PoolTransfer
from .plan import Plan, chunks, mark

__all__ = ["IoPath", "Ownership", "Request", "TransferPath", "select_io_path"]

log = logging.getLogger("hicache")
T = TypeVar("T")
IoPath = Literal["v1", "v2"]


def select_io_path(capabilities: Capabilities, layout: Layout) -> IoPath | None:
    """The I/O path for a backend declaring ``capabilities`` over host pools in ``layout``.

    v2 when the backend declares it and the layout allows it (zero-copy v2 needs
    ``page_first``), otherwise v1; ``None`` when the backend offers neither for this layout
    (a zero-copy-v2-only backend over ``layer_first`` pools).
    """
    if capabilities.v2 and (layout is Layout.PAGE_FIRST or not capabilities.zero_copy):
        return "v2"
    return "v1" if capabilities.v1 else None


class Ownership:
    """Whether an operation may still touch its caller's host slots.

    On a staged path every copy between staging memory and the caller's host slots happens
    under ``lock`` and only while ``abandoned`` is False. :meth:`abandon` takes the lock, so once
    it returns no copy of the operation touches the slots again, whatever its backend calls do
    later: they only ever see the operation's own staging memory.
    """

    __slots__ = ("abandoned", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True


class Request:
    """One operation's state: its validated page hashes, the errors met so far, the keys
    resolved so far (per pool, one entry per position; each page's keys are asked of the
    ``hicache_page_keys`` hook once per operation), and its :class:`Ownership` of host slots."""

    __slots__ = ("errors", "hashes", "keys", "owner")

    def __init__(self, page_hashes: Sequence[str], owner: Ownership | None = None) -> None:
        self.hashes = ValidHashes(page_hashes)
        self.errors: list[str] = []
        self.keys: dict[PoolName, list[tuple[str, ...] | None]] = {}
        self.owner = owner if owner is not None else Ownership()


class TransferPath:
    """Batch I/O of plans through ``store`` on ``io_path`` (see the module docstring).

    ``io_timeout_s`` bounds each storage call (run on ``call_pool``); past it the call's pages
    are reported failed. ``owner`` is False on ranks that must not write rank-replicated pools.

    ``staged``: every GET and SET goes through staging memory of its own (v1 only): a SET copies
    the pages out of the host slots before the call, a GET copies them in after it returns, both
    under the request's :class:`Ownership`. A call that is abandoned (timed out, or its operation
    past a deadline or closed) then never touches host memory again and never publishes bytes
    other than the ones handed over; the price is one copy of every page moved.
    """

    def __init__(
        self,
        store: Store,
        io_path: IoPath,
        *,
        batch_pages: int,
        owner: bool = True,
        io_timeout_s: float | None = None,
        call_pool: Executor | None = None,
        staged: bool = False,
    ) -> None:
        if io_timeout_s is not None and call_pool is None:
            raise ValueError("TransferPath: io_timeout_s needs a call_pool to run bounded calls on")
        if staged and io_path != "v1":
            raise ValueError("TransferPath: a staged path moves pages through staging buffers, on v1")
        self.store = store
        self.io_path = io_path
        self.batch_pages = batch_pages
        self.owner = owner
        self.io_timeout_s = io_timeout_s
        self.call_pool = call_pool
        self.staged = staged
        self.skips_existing = store.capabilities.set_skips_existing

    # ------------------------------------------------------------ one batch
    def keys(self, req: Request, plan: Plan) -> list[tuple[str, ...]]:
        """The component keys of ``plan``'s pages."""
        cache = req.keys.get(plan.name)
        if cache is None:
            if len(plan.positions) == len(req.hashes):  # the whole request: one hook call
                keys = self.store.page_keys(plan.name, req.hashes)
                req.keys[plan.name] = keys  # type: ignore[assignment]
                return keys
            cache = req.keys[plan.name] = [None] * len(req.hashes)
        elif len(plan.positions) == len(req.hashes) and None not in cache:
            return cache  # type: ignore[return-value]
        todo = [i for i in plan.positions if cache[i] is None]
        if todo:
            resolved = self.store.page_keys(plan.name, req.hashes.pick(todo))
            for i, k in zip(todo, resolved):
                cache[i] = k
        return [cache[i] for i in plan.positions]  # type: ignore[misc]

    def transfers(self, req: Request, plans: Sequence[Plan]) -> list[PoolTransfer]:
        """The v2 ``PoolTransfer`` of each plan: its pool, host pages, page hashes and keys."""
        whole = len(req.hashes)
        return [
            PoolTransfer(
                p.name,
                tuple(p.indices),
                req.hashes if len(p.positions) == whole else req.hashes.pick(p.positions),
                HitPolicy(p.pool.hit_policy),
                tuple(self.keys(req, p)),
            )
            for p in plans
        ]

    def io(
        self, req: Request, op: IoOp, plans: Sequence[Plan], transfers: list[PoolTransfer] | None = None
    ) -> list[list[bool]]:
        """One storage call for ``plans`` (v2), or one per plan (v1); per plan, one bool per page.

        ``transfers``: the plans' v2 transfers when already built for them (a put's SET reuses
        its EXISTS call's transfers when no page was found stored).
        """
        if self.io_path == "v2":
            batch = self.transfers(req, plans) if transfers is None else transfers
            return self._guard(
                req, op, lambda: self.store.batch_io_v2(op, batch), [len(p.positions) for p in plans]
            )
        return [self._io_v1(req, op, p) for p in plans]

    def _io_v1(self, req: Request, op: IoOp, plan: Plan) -> list[bool]:
        n, ncomp = len(plan.positions), len(plan.pool.components)
        if n == 0:
            return []
        keys = [k for page in self.keys(req, plan) for k in page]
        views = (
            None if op is IoOp.EXISTS else [v for page in plan.pool.page_views(plan.indices) for v in page]
        )
        buffers = views
        if self.staged and views is not None:
            buffers = _staging(views)
            if op is IoOp.SET:
                with req.owner.lock:  # the bytes handed over are copied before the call
                    if req.owner.abandoned:
                        return [False] * n
                    for staged, view in zip(buffers, views):
                        staged.copy_(view)
        flat = self._guard(
            req, op, lambda: [self.store.batch_io_v1(op, keys, buffers, plan.name)], [len(keys)]
        )[0]
        if self.staged and op is IoOp.GET and views is not None and buffers is not None:
            with req.owner.lock:  # host slots are written only while the operation owns them
                if req.owner.abandoned:
                    return [False] * n
                for ok, staged, view in zip(flat, buffers, views):
                    if ok:
                        view.copy_(staged)
        if ncomp == 1:
            return flat
        return [all(flat[i * ncomp : (i + 1) * ncomp]) for i in range(n)]  # all components done

    def _guard(
        self, req: Request, op: IoOp, call: Callable[[], list[list[bool]]], sizes: list[int]
    ) -> list[list[bool]]:
        try:
            return call() if self.io_timeout_s is None else self._bounded(call)
        except Exception as err:
            n = sum(sizes)
            msg = f"backend {self.store.name!r} failed {op.value} of {n} entries: {type(err).__name__}: {err}"
            log.error("hicache: %s", msg, exc_info=not isinstance(err, HiCacheError))
            req.errors.append(msg)
            return [[False] * s for s in sizes]

    def _bounded(self, call: Callable[[], T]) -> T:
        assert self.call_pool is not None and self.io_timeout_s is not None
        future = self.call_pool.submit(call)
        try:
            return future.result(timeout=self.io_timeout_s)
        except FuturesTimeout:
            raise BackendTimeoutError(
                f"no answer within io_timeout_s={self.io_timeout_s}s; the call was abandoned and its "
                "pages are reported failed (raise io_timeout_s if the backend is just slow)"
            ) from None

    # ------------------------------------------------------------- requests
    def exists(
        self, req: Request, plans: Sequence[Plan], *, until_miss: bool = True
    ) -> dict[PoolName, list[bool]]:
        """Per plan, whether each page is stored (flag ``i`` answers the plan's ``i``-th position).

        ``until_miss``: stop after the batch in which an all-pages pool (KV) misses a page; the
        pages not asked about count as missing.
        """
        flags, base = _new_flags(plans)
        for start, stop in chunks(len(req.hashes), self.batch_pages):
            batch = _window(plans, start, stop)
            missed = False
            for w, ok in zip(batch, self.io(req, IoOp.EXISTS, batch)):
                mark(flags[w.name], base[w.name], w.positions, ok)
                missed = missed or (w.pool.hit_policy is HitPolicy.ALL_PAGES and not all(ok))
            if missed and until_miss:
                break
        return flags

    def put(self, req: Request, plans: Sequence[Plan]) -> tuple[dict[PoolName, list[bool]], int]:
        """Write ``plans``' pages, skipping stored ones. Returns per plan one bool per page, and
        the number of pages not written (found stored, or another rank's to write)."""
        flags, base = _new_flags(plans)
        skipped = 0
        for start, stop in chunks(len(req.hashes), self.batch_pages):
            writable = []
            for w in _window(plans, start, stop):
                if self.owner or not w.pool.rank_replicated:
                    writable.append(w)
                else:  # rank-replicated data (MLA KV): rank 0 writes it
                    mark(flags[w.name], base[w.name], w.positions, [True] * len(w.positions))
                    skipped += len(w.positions)
            if not writable:
                continue
            todo = writable
            transfers = self.transfers(req, writable) if self.io_path == "v2" else None
            if not self.skips_existing:  # else SET itself keeps stored objects: no round trip
                todo = []
                for w, ok in zip(writable, self.io(req, IoOp.EXISTS, writable, transfers)):
                    mark(flags[w.name], base[w.name], w.positions, ok)
                    stored = sum(ok)
                    if stored:
                        skipped += stored
                        transfers = None  # the SET moves only the rest: its own transfers
                    rest = w.missing(ok)
                    if rest is not None:
                        todo.append(rest)
            if todo:
                for w, ok in zip(todo, self.io(req, IoOp.SET, todo, transfers)):
                    mark(flags[w.name], base[w.name], w.positions, ok)
        return flags, skipped

    def get(
        self,
        req: Request,
        plans: Sequence[Plan],
        *,
        until_miss: bool = True,
        stopped: Callable[[], bool] | None = None,
        flags: dict[PoolName, list[bool]] | None = None,
    ) -> dict[PoolName, list[bool]]:
        """Read ``plans``' pages; per plan, one bool per page.

        ``until_miss``: stop after the first batch with a page not read (later pages would not be
        usable). ``stopped`` is asked before each batch; once it answers True no batch starts.
        ``flags``: all-False flags to fill in place (so another thread can read the progress).
        """
        new, base = _new_flags(plans)
        flags = new if flags is None else flags
        for start, stop in chunks(len(req.hashes), self.batch_pages):
            if stopped is not None and stopped():
                break
            batch = _window(plans, start, stop)
            complete = True
            for w, ok in zip(batch, self.io(req, IoOp.GET, batch)):
                mark(flags[w.name], base[w.name], w.positions, ok)
                complete = complete and all(ok)
            if until_miss and not complete:
                break
        return flags


def _window(plans: Sequence[Plan], start: int, stop: int) -> list[Plan]:
    """The non-empty parts of ``plans`` whose positions fall in ``[start, stop)``."""
    return [w for p in plans if (w := p.window(start, stop)).positions]


def _new_flags(plans: Sequence[Plan]) -> tuple[dict[PoolName, list[bool]], dict[PoolName, int]]:
    """Per plan, all-False flags and its first position (flag ``i`` is position base + i)."""
    flags = {p.name: [False] * len(p.positions) for p in plans}
    base = {p.name: p.positions[0] if p.positions else 0 for p in plans}
    return flags, base


def _staging(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous buffers shaped like ``views``, carved from one allocation of this call's own."""
    memory = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8)
    out, offset = [], 0
    for v in views:
        size = v.numel()
        out.append(memory[offset : offset + size].view(v.shape))
        offset += size
    return out
