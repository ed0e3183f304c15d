"""The scheduler side of the connector: which pages a request can load, and which it must save.

vLLM's block is hicache's page. A request's page hashes are hicache's chained hashes of its
prompt tokens (:func:`hicache_core.page_hashes`, one per full block), so the keys are the same
as everywhere in hicache and any process serving the same model with the same store finds them.

* :meth:`SchedulerSide.matched_tokens` answers ``get_num_new_matched_tokens``: one batched
  existence query (through the core's ``TransferPath``) for the pages after vLLM's own
  prefix-cache hit, counting the leading stored ones. The last prompt token is never claimed:
  vLLM must compute at least one token to sample from. Any failure answers 0 (recompute).
* :meth:`after_alloc` records the load a request was granted; :meth:`build` turns the granted
  loads and the prompt pages completed by this step into :class:`PageOps` for the worker. An
  asynchronous load (``async_load``) is a request vLLM does not schedule until the worker
  reports it loaded, so its page op is made at allocation and sent with the next step.
* Only full prompt pages are saved, each once per request. Pages vLLM already had (its prefix
  cache) are not; loaded pages are offered again, so a page that failed to load and was
  recomputed is written back (the backend skips pages it holds: ``set_skips_existing`` or the
  path's existence pass).

Nothing here imports vLLM: the connector hands in plain values (token ids, block ids), so the
bookkeeping is tested without an engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hicache_core import HostPool, PoolName, Store, page_hashes
from hicache_core.transfer import Plan, Request, TransferPath

__all__ = ["PageOp", "PageOps", "SchedulerSide"]

log = logging.getLogger("hicache.vllm")


@dataclass
class PageOp:
    """Pages of one request: ``hashes[i]`` lives in (or goes to) vLLM block ``block_ids[i]``."""

    req_id: str
    hashes: list[str]
    block_ids: list[int]


@dataclass
class PageOps:
    """One step's work for the worker: loads (before the forward pass) and saves (after it)."""

    loads: list[PageOp] = field(default_factory=list)
    saves: list[PageOp] = field(default_factory=list)
    async_loads: list[PageOp] = field(default_factory=list)


@dataclass
class _ReqState:
    hashes: list[str]
    prompt_len: int
    lookup_start: int = 0  # first page after vLLM's own hit at the last lookup
    load_start: int = 0  # first page of the granted load
    load_pages: int = 0  # pages granted (0: nothing to load)
    load_sent: bool = False
    saved_upto: int = 0  # pages below this are stored (or were there already)
    max_pages: int | None = None  # an asynchronous load failed here: never claim from here on


@dataclass
class LookupStats:
    """Tokens asked about and found by the scheduler-side lookups (vLLM's external hit rate)."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    errors: int = 0


class SchedulerSide:
    """Per-request page bookkeeping of the scheduler (see the module docstring)."""

    def __init__(self, store: Store, pool: HostPool, path: TransferPath, block_size: int) -> None:
        self.store = store
        self.pool = pool
        self.path = path
        self.block_size = block_size
        self.stats = LookupStats()
        self._reqs: dict[str, _ReqState] = {}
        self._async_loads: list[PageOp] = []

    def _state(self, req_id: str, prompt: Sequence[int]) -> _ReqState:
        st = self._reqs.get(req_id)
        if st is None or st.prompt_len != len(prompt):
            st = _ReqState(page_hashes(list(prompt), self.block_size), len(prompt))
            self._reqs[req_id] = st
        return st

    def matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens after ``num_computed_tokens`` (block-aligned) that the store can provide."""
        bs = self.block_size
        try:
            st = self._state(req_id, prompt)
            start = st.lookup_start = num_computed_tokens // bs
            usable = (len(prompt) - 1) // bs  # never the last prompt token
            if st.max_pages is not None:
                usable = min(usable, st.max_pages)
            if usable <= start:
                return 0
            hashes = st.hashes[start:usable]
            plan = Plan(PoolName.KV, self.pool, list(range(len(hashes))), [0] * len(hashes))
            flags = self.path.exists(Request(hashes), [plan])[PoolName.KV]
            found = flags.index(False) if False in flags else len(flags)
        except Exception as err:  # the store is a cache: a failed lookup is a miss
            self.stats.errors += 1
            log.error(
                "hicache-vllm: lookup failed on backend %r (recomputing): %s: %s",
                self.store.name,
                type(err).__name__,
                err,
            )
            return 0
        self.stats.queries += 1
        self.stats.query_tokens += (usable - start) * bs
        self.stats.hit_tokens += found * bs
        return found * bs

    def after_alloc(
        self,
        req_id: str,
        prompt: Sequence[int],
        external: int,
        async_blocks: Sequence[int] | None = None,
    ) -> None:
        """vLLM allocated blocks for ``external`` tokens to load after its own hit (the
        ``num_computed_tokens`` of the last lookup). ``async_blocks``: the request's block ids
        when the load is asynchronous; its op goes out with the next :meth:`build`. It always
        goes out (the worker must report every asynchronous load): pages without a block are
        sent with empty lists, which the worker reports as a failed load."""
        st = self._state(req_id, prompt)
        bs = self.block_size
        st.load_start = st.lookup_start
        st.load_pages = external // bs
        st.load_sent = False
        if async_blocks is not None and st.load_pages:
            first, stop = st.load_start, st.load_start + st.load_pages
            if stop <= len(async_blocks):
                op = PageOp(req_id, st.hashes[first:stop], list(async_blocks[first:stop]))
            else:
                log.error("hicache-vllm: request %s has no blocks for its granted load", req_id)
                op = PageOp(req_id, [], [])
            self._async_loads.append(op)
            st.load_sent = True
        # Loaded pages are saved again: a page that fails to load is recomputed and written back
        # (the backend skips the pages it still holds).
        st.saved_upto = st.load_start

    def load_failed(self, req_id: str, good_pages: int) -> None:
        """The asynchronous load granted to ``req_id`` loaded only its first ``good_pages``
        pages: vLLM recomputes the request and asks again; claim no page from the failed one on
        (this also ends the retries of a page that stays broken)."""
        st = self._reqs.get(req_id)
        if st is not None:
            cap = st.load_start + good_pages
            st.max_pages = cap if st.max_pages is None else min(st.max_pages, cap)

    def build(
        self,
        scheduled: Sequence[tuple[str, int, int]],
        block_ids: Callable[[str], Sequence[int]],
    ) -> PageOps:
        """This step's loads and saves. ``scheduled`` holds ``(req_id, num_computed_tokens,
        num_scheduled_tokens)`` of every scheduled request; ``block_ids(req_id)`` its blocks."""
        ops = PageOps(async_loads=self._async_loads)
        self._async_loads = []
        for req_id, computed, new in scheduled:
            st = self._reqs.get(req_id)
            if st is None:
                continue
            try:
                blocks = list(block_ids(req_id))
            except Exception as err:
                log.error("hicache-vllm: no block ids for request %s: %s", req_id, err)
                continue
            if st.load_pages and not st.load_sent:
                first, stop = st.load_start, st.load_start + st.load_pages
                if stop <= len(blocks):
                    ops.loads.append(PageOp(req_id, st.hashes[first:stop], blocks[first:stop]))
                st.load_sent = True
            if computed < st.saved_upto * self.block_size:
                # vLLM rewound the request (a load failed, or it was preempted): the pages from
                # here on are computed again in this step, so they are saved again after it.
                st.saved_upto = computed // self.block_size
            full = min(computed + new, st.prompt_len) // self.block_size
            full = min(full, len(st.hashes), len(blocks))
            if full > st.saved_upto:
                first = st.saved_upto
                ops.saves.append(PageOp(req_id, st.hashes[first:full], blocks[first:full]))
                st.saved_upto = full
        return ops

    def finished(self, req_id: str) -> None:
        """Forget a finished request."""
        self._reqs.pop(req_id, None)

    def close(self) -> None:
        self._reqs.clear()
        self.store.close()
