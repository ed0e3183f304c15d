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
from concurrent.futures import TimeoutError as FuturesTimeout
from functools import partial
from itertools import chain
from typing import Literal, TypeVar

import torch

from ..errors import BackendTimeoutError, HiCacheError
from ..paging import ValidHashes
from ..plugin import Store
from ..types import Capabilities, HitPolicy, IoOp, Layout, PageKeys, PoolName, PoolTransfer
from .calls import CallPool
from .plan import Plan, chunks

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
    resolved so far (per pool: the whole request's :class:`PageKeys`, or one entry per position
    when only some were asked for; each page's keys are asked of the ``hicache_page_keys`` hook
    once per operation), and its :class:`Ownership` of host slots (``None`` for a synchronous
    operation on a store that is not staged: nothing can abandon it)."""

    __slots__ = ("errors", "hashes", "keys", "owner")

    def __init__(self, page_hashes: Sequence[str], owner: Ownership | None = None) -> None:
        self.hashes = ValidHashes(page_hashes)
        self.errors: list[str] = []
        self.keys: dict[PoolName, Sequence[tuple[str, ...] | None]] = {}
        self.owner = owner


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
        call_pool: CallPool | None = None,
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
        self.v2 = io_path == "v2"

    # ------------------------------------------------------------ one batch
    def keys(self, req: Request, plan: Plan, hashes: ValidHashes | None = None) -> PageKeys:
        """The component keys of ``plan``'s pages (``hashes``: its page hashes, when the caller
        has picked them already)."""
        cache = req.keys.get(plan.name)
        pos = plan.positions
        whole = len(pos) == len(req.hashes)
        run = pos if type(pos) is range and pos.step == 1 else None  # a window of consecutive positions
        if type(cache) is PageKeys:  # the whole request's keys, resolved by one hook call
            if whole:
                return cache
            return PageKeys(
                cache[run.start : run.stop] if run is not None else tuple(map(cache.__getitem__, pos))
            )
        if cache is None:
            if whole:
                keys = req.keys[plan.name] = self.store.page_keys(plan.name, req.hashes)
                return keys
            cache = req.keys[plan.name] = [None] * len(req.hashes)
        assert isinstance(cache, list)
        if run is not None:  # slices instead of a Python loop over the window's positions
            part = cache[run.start : run.stop]
            missing = part.count(None)
            if missing == 0:
                return PageKeys(part)
            if missing == len(part):  # none resolved yet: one hook call for the window
                resolved = self.store.page_keys(plan.name, req.hashes.pick(run) if hashes is None else hashes)
                cache[run.start : run.stop] = resolved
                return resolved
        todo = [i for i in pos if cache[i] is None]
        if not todo:
            return PageKeys(tuple(map(cache.__getitem__, pos)))
        resolved = self.store.page_keys(plan.name, req.hashes.pick(todo))
        for i, k in zip(todo, resolved):
            cache[i] = k
        if len(todo) == len(pos):
            return resolved  # every page of the plan was just resolved, in its order
        return PageKeys(tuple(map(cache.__getitem__, pos)))

    def transfers(self, req: Request, plans: Sequence[Plan]) -> list[PoolTransfer]:
        """The v2 ``PoolTransfer`` of each plan: its pool, host pages, page hashes and keys."""
        n = len(req.hashes)
        out = []
        for p in plans:
            if len(p.positions) == n:
                hashes = req.hashes
                keys = req.keys.get(p.name)
                if keys is None:  # the whole request's keys, from one hook call
                    keys = req.keys[p.name] = self.store.page_keys(p.name, hashes)
                elif type(keys) is not PageKeys:
                    keys = self.keys(req, p)
            else:
                hashes = req.hashes.pick(p.positions)
                keys = self.keys(req, p, hashes)
            # plain tuples and PageKeys: PoolTransfer keeps them as they are
            out.append(PoolTransfer(p.name, tuple(p.indices), tuple(hashes), p.pool.hit_policy, keys))
        return out

    def io(
        self, req: Request, op: IoOp, plans: Sequence[Plan], transfers: list[PoolTransfer] | None = None
    ) -> list[list[bool]]:
        """One storage call for ``plans`` (v2), or one per plan (v1); per plan, one bool per page
        (a list of this call's own). A failing or timed-out call reports its pages failed.

        ``transfers``: the plans' v2 transfers when already built for them (a put's SET reuses
        its EXISTS call's transfers when no page was found stored).
        """
        if not self.v2:
            return [self._io_v1(req, op, p) for p in plans]
        try:  # a failing hicache_page_keys fails the batch's pages, like a failing I/O call
            batch = self.transfers(req, plans) if transfers is None else transfers
            if self.io_timeout_s is None:
                return self.store.batch_io_v2(op, batch)
            return self._bounded(partial(self.store.batch_io_v2, op, batch))
        except Exception as err:
            return self._failed(req, op, err, [len(p.positions) for p in plans])

    def _io_v1(self, req: Request, op: IoOp, plan: Plan) -> list[bool]:
        n = len(plan.positions)
        if n == 0:
            return []
        ncomp = len(plan.pool.components)
        try:  # a failing hicache_page_keys fails the batch's pages, like a failing I/O call
            keys = [*chain.from_iterable(self.keys(req, plan))]
        except Exception as err:
            self._failed(req, op, err, [n * ncomp])
            return [False] * n
        views = None if op is _EXISTS else [v for page in plan.pool.page_views(plan.indices) for v in page]
        buffers = views
        owner = req.owner
        if self.staged and views is not None:
            if owner is None:  # a synchronous operation: only a timeout abandons it
                owner = req.owner = Ownership()
            buffers = _staging(views)
            if op is _SET:
                with owner.lock:  # the bytes handed over are copied before the call
                    if owner.abandoned:
                        return [False] * n
                    for staged, view in zip(buffers, views):
                        staged.copy_(view)
        try:
            if self.io_timeout_s is None:
                flat = self.store.batch_io_v1(op, keys, buffers, plan.name)
            else:
                flat = self._bounded(partial(self.store.batch_io_v1, op, keys, buffers, plan.name))
        except Exception as err:
            self._failed(req, op, err, [len(keys)])
            return [False] * n
        if self.staged and op is _GET and views is not None and buffers is not None:
            assert owner is not None
            with owner.lock:  # host slots are written only while the operation owns them
                if owner.abandoned:
                    return [False] * n
                for ok, staged, view in zip(flat, buffers, views):
                    if ok:
                        view.copy_(staged)
        if ncomp == 1:
            return flat
        return [all(flat[i * ncomp : (i + 1) * ncomp]) for i in range(n)]  # all components done

    def _failed(self, req: Request, op: IoOp, err: Exception, sizes: list[int]) -> list[list[bool]]:
        """Record a failed storage call (logged, and in ``req.errors``); every entry is False."""
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
            self.call_pool.abandoned(future)
            raise BackendTimeoutError(
                f"no answer within io_timeout_s={self.io_timeout_s}s; the call was abandoned and its "
                "pages are reported failed (raise io_timeout_s if the backend is just slow)"
            ) from None

    # ------------------------------------------------------------- requests
    # Results are folded in one pass: a plan's windows are consecutive runs of its positions, so
    # its flags are its windows' answers appended batch by batch; when a read stops early, the
    # pages never asked about are padded False at the end.
    def exists(
        self, req: Request, plans: Sequence[Plan], *, until_miss: bool = True
    ) -> dict[PoolName, list[bool]]:
        """Per plan, whether each page is stored (flag ``i`` answers the plan's ``i``-th position).

        ``until_miss``: stop after the batch in which an all-pages pool (KV) misses a page; the
        pages not asked about count as missing.
        """
        flags: dict[PoolName, list[bool]] = {}
        for p in plans:
            flags[p.name] = []
        for batch in _batches(plans, len(req.hashes), self.batch_pages):
            missed = False
            for w, ok in zip(batch, self.io(req, _EXISTS, batch)):
                if flags[w.name]:
                    flags[w.name] += ok
                else:  # the plan's first window: its answers, a list of our own
                    flags[w.name] = ok
                if not missed and w.pool.hit_policy is _ALL_PAGES and not all(ok):
                    missed = True
            if missed and until_miss:
                return _padded(flags, plans)
        return flags

    def put(self, req: Request, plans: Sequence[Plan]) -> tuple[dict[PoolName, list[bool]], int]:
        """Write ``plans``' pages, skipping stored ones. Returns per plan one bool per page, and
        the number of pages not written (found stored, or another rank's to write)."""
        flags: dict[PoolName, list[bool]] = {}
        for p in plans:
            flags[p.name] = []
        skipped = 0
        for batch in _batches(plans, len(req.hashes), self.batch_pages):
            writable = []
            for w in batch:
                if self.owner or not w.pool.rank_replicated:
                    writable.append(w)
                else:  # rank-replicated data (MLA KV): rank 0 writes it
                    flags[w.name] += [True] * len(w.positions)
                    skipped += len(w.positions)
            if not writable:
                continue
            transfers = None
            if self.v2:
                try:  # a failing hicache_page_keys fails the window's pages
                    transfers = self.transfers(req, writable)
                except Exception as err:
                    failed = self._failed(req, _SET, err, [len(w.positions) for w in writable])
                    for w, ok in zip(writable, failed):
                        flags[w.name] += ok
                    continue
            if self.skips_existing:  # SET itself keeps stored objects: no round trip
                for w, ok in zip(writable, self.io(req, _SET, writable, transfers)):
                    if flags[w.name]:
                        flags[w.name] += ok
                    else:  # the plan's first window: its answers, a list of our own
                        flags[w.name] = ok
                continue
            found = self.io(req, _EXISTS, writable, transfers)
            todo, rests = [], []
            for w, ok in zip(writable, found):
                stored = sum(ok)
                if stored:
                    skipped += stored
                    transfers = None  # the SET moves only the rest: its own transfers
                rest = w.missing(ok) if stored else w  # nothing stored: the whole window
                if rest is not None:
                    todo.append(rest)
                rests.append(rest)
            written = iter(self.io(req, _SET, todo, transfers) if todo else ())
            for w, ok, rest in zip(writable, found, rests):
                if rest is not None:  # fill the pages found missing with the SET's answers
                    done = next(written)
                    ok = done if rest is w else _merge(ok, done)
                if flags[w.name]:
                    flags[w.name] += ok
                else:  # the plan's first window: its answers, a list of our own
                    flags[w.name] = ok
        return flags, skipped  # every window of every plan answered: nothing to pad

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
        ``flags``: a dict to fill as batches land, so another thread can read the progress: each
        plan's list (an empty one is added for a plan without) grows by one window per batch and
        is padded with False when the read stops.
        """
        out: dict[PoolName, list[bool]] = {} if flags is None else flags
        for p in plans:
            out.setdefault(p.name, [])
        for batch in _batches(plans, len(req.hashes), self.batch_pages):
            if stopped is not None and stopped():
                return _padded(out, plans)
            complete = True
            for w, ok in zip(batch, self.io(req, _GET, batch)):
                if out[w.name]:
                    out[w.name] += ok
                else:  # the plan's first window: its answers, a list of our own
                    out[w.name] = ok
                if complete and not all(ok):
                    complete = False
            if until_miss and not complete:
                return _padded(out, plans)
        return out


# Enum members looked up once: on Python 3.11 each ``IoOp.GET`` costs a Python-level call.
_EXISTS, _GET, _SET = IoOp.EXISTS, IoOp.GET, IoOp.SET
_ALL_PAGES = HitPolicy.ALL_PAGES


def _batches(plans: Sequence[Plan], n: int, step: int) -> list[list[Plan]]:
    """An ``n``-page request in batches of ``step`` positions: per batch, the non-empty parts
    (windows) of ``plans`` whose positions fall in it."""
    if n <= step:  # one batch: every plan is its own window
        one = []
        for p in plans:
            if p.positions:
                one.append(p)
        return [one] if n else []
    out = []
    for start, stop in chunks(n, step):
        batch = []
        for p in plans:
            w = p.window(start, stop)
            if w.positions:
                batch.append(w)
        out.append(batch)
    return out


def _padded(flags: dict[PoolName, list[bool]], plans: Sequence[Plan]) -> dict[PoolName, list[bool]]:
    """``flags`` with each plan's list as long as the plan (pages never asked about: False)."""
    for p in plans:
        have = flags[p.name]
        if len(have) < len(p.positions):
            have += [False] * (len(p.positions) - len(have))
    return flags


def _merge(found: list[bool], written: list[bool]) -> list[bool]:
    """``found`` with its False entries replaced, in order, by ``written``'s."""
    it = iter(written)
    return [True if f else next(it) for f in found]


def _staging(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous buffers shaped like ``views``, carved from one allocation of this call's own."""
    memory = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8)
    out, offset = [], 0
    for v in views:
        size = v.numel()
        out.append(memory[offset : offset + size].view(v.shape))
        offset += size
    return out
