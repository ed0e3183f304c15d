"""The worker side of the connector: vLLM's KV cache as a hicache pool, and the page moves.

``register_kv_caches`` hands over one tensor per attention layer; vLLM 0.32 views them as
``[blocks, heads, block_size, content]`` over one allocation. :meth:`WorkerSide.register` builds
an :class:`hicache_core.pools.ExternalPool` over the SAME memory (no copy): the geometry (how
many runs of bytes a block has per layer, their strides) is read from the tensors' shapes and
strides, so any layout where blocks are dim 0 works (CPU ``LBHNC``: one run per layer; a
block-outermost layout: one contiguous run per page, zero-copy for v2 backends; heads outside
blocks: one run per layer and head). Every load and save goes through the core's
``TransferPath`` on the I/O path ``select_io_path`` picks for the backend and the pool layout.

Failure never means wrong tokens: a page that fails to load (missing, corrupt, backend error)
is reported with every later page of its request through :meth:`load_errors`, and vLLM
recomputes them; a failed save is logged and counted, nothing else happens. No method raises
into the engine after registration.

Asynchronous loads (``async_load``) run the same per-request load on one background thread;
:meth:`finished_loads` reports a request once its load has written every page it will write,
or once a load not yet started was cancelled because vLLM finished (aborted) the request. A
request whose asynchronous load failed in part is reported whole through
:meth:`failed_requests` (with how many leading pages were good), before or with its
``finished_recving``: vLLM then frees its blocks and asks the scheduler again, which claims only
the good pages, so ``num_cached_tokens`` counts what was really loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hicache_core import ConfigError, Layout, PoolName, StorageConfig, Store, open_store
from hicache_core.pools import ExternalPool
from hicache_core.transfer import CallPool, Plan, Request, TransferPath, select_io_path

from ._scheduler import PageOp

__all__ = ["TransferStats", "WorkerSide", "check_io_timeout"]

log = logging.getLogger("hicache.vllm")


def check_io_timeout(store: Store, config: StorageConfig) -> None:
    """Refuse ``io_timeout_s`` on a backend without v1, as ``CacheController`` does: a call
    abandoned at the timeout must move pages through staging buffers, which only v1 takes."""
    if config.controller.io_timeout_s is not None and not store.capabilities.v1:
        raise ConfigError(
            f"backend {store.name!r} implements only v2, which moves pages straight from and to "
            "host memory, so a call abandoned by io_timeout_s could still write vLLM's KV blocks "
            "later; leave io_timeout_s unset with this backend"
        )


@dataclass
class TransferStats:
    """What the worker moved: pages, bytes and seconds of loads and saves, and failures."""

    load_pages: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    load_failed_pages: int = 0
    save_pages: int = 0
    save_bytes: int = 0
    save_s: float = 0.0
    save_failed_pages: int = 0


class WorkerSide:
    """The worker half: pool, store, transfer path, pending load errors and async saves."""

    def __init__(
        self, config: StorageConfig, block_size: int, *, async_save: bool, async_load: bool = False
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.async_save = async_save
        self.stats = TransferStats()
        self.pool: ExternalPool | None = None
        self.store: Store | None = None
        self.path: TransferPath | None = None
        self._errors: set[int] = set()
        self._lock = threading.Lock()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="hicache-vllm-save") if async_save else None
        self._pending: dict[str, list[Future[None]]] = {}
        self._finished_waiting: set[str] = set()
        # Blocks whose load failed in this step: they hold no valid KV until vLLM recomputes
        # them in a later step, so this step never saves them (nor any later page of the request).
        self._failed_step: set[int] = set()
        self._calls: CallPool | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="hicache-vllm-load") if async_load else None
        self._loading: dict[str, Future[None]] = {}
        self._failed_reqs: dict[str, int] = {}
        self._short_loads: dict[str, int] = {}  # synchronous loads that failed in part

    # --------------------------------------------------------------- set-up
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """View vLLM's per-layer KV tensors as one hicache pool and open the store over it.

        The config's ``layout`` becomes the pool's (vLLM's CPU ``LBHNC`` cache: ``layer_first``);
        it is part of the key namespace, so the scheduler learns it through the handshake
        (:meth:`layout`). An MLA cache is the same on every tensor-parallel rank: its pool is
        rank-replicated, one key per page that rank 0 writes and every rank reads."""
        tensors = list(kv_caches.values())
        pool = ExternalPool.from_block_tensors(
            tensors, page_size=self.block_size, rank_replicated=self.config.is_mla_model
        )
        if pool.layout is not self.config.layout:
            self.config = self.config.model_copy(update={"layout": pool.layout})
        store = open_store(self.config)
        try:
            check_io_timeout(store, self.config)
            io_path = select_io_path(store.capabilities, pool.layout)
            if io_path is None:
                raise RuntimeError(
                    f"backend {store.name!r} implements only zero-copy v2, which needs page-contiguous "
                    f"blocks; vLLM's KV layout here gives a {pool.layout.value} pool"
                )
            store.register_pool(PoolName.KV, pool)
        except BaseException:
            store.close()
            raise
        settings = self.config.controller
        self.pool, self.store = pool, store
        owner = self.config.tp_rank == 0  # writes rank-replicated (MLA) pages
        timeout = settings.io_timeout_s
        if timeout is not None:
            # a call abandoned at the timeout must never write vLLM's blocks later: staged v1
            self._calls = CallPool(4, "hicache-vllm-call")
            self.path = TransferPath(
                store,
                "v1",
                batch_pages=settings.batch_pages,
                owner=owner,
                io_timeout_s=timeout,
                call_pool=self._calls,
                staged=True,
            )
            io_path = "v1"
        else:
            self.path = TransferPath(store, io_path, batch_pages=settings.batch_pages, owner=owner)
        g = pool.geometry
        log.info(
            "hicache-vllm: backend %r over vLLM's KV cache in place: %d blocks of %d runs x %d bytes "
            "(%s pool, %s path, namespace %s)",
            store.name,
            g.num_blocks,
            g.runs,
            g.run_nbytes,
            pool.layout.value,
            io_path,
            store.keys.scheme.namespace,
        )

    @property
    def layout(self) -> Layout | None:
        """The registered pool's layout (``None`` before a successful :meth:`register`)."""
        return self.pool.layout if self.pool is not None else None

    # ---------------------------------------------------------------- loads
    def load(self, ops: Sequence[PageOp]) -> None:
        """Read the pages of ``ops`` into their vLLM blocks; failed blocks go to :meth:`load_errors`."""
        self._failed_step = set()
        for op in ops:
            if op.hashes:
                good = self._load_checked(op)
                if good < len(op.hashes):
                    # vLLM truncates the request at its first failed block: that one and the rest
                    failed = op.block_ids[good:]
                    with self._lock:
                        self._errors.update(failed)
                        self._short_loads[op.req_id] = good
                    self._failed_step.update(failed)

    def _load_checked(self, op: PageOp) -> int:
        """Load one request's pages; the number of leading pages loaded (the rest failed)."""
        ok = self._load_one(op)
        n = len(op.hashes)
        good = ok.index(False) if False in ok else n
        if good == n:
            return n
        self.stats.load_failed_pages += n - good
        log.warning(
            "hicache-vllm: request %s loaded %d of %d pages; vLLM recomputes the rest",
            op.req_id,
            good,
            n,
        )
        return good

    def start_async_loads(self, ops: Sequence[PageOp]) -> None:
        """Start the loads of ``ops`` on the load thread (:meth:`finished_loads` reports them)."""
        for op in ops:
            fut: Future[None] = Future()
            if not op.hashes:  # no block to write: the whole request is recomputed
                with self._lock:
                    self._failed_reqs[op.req_id] = 0
                fut.set_result(None)
            elif self._loader is None:
                self._load_async(op)
                fut.set_result(None)
            else:
                fut = self._loader.submit(self._load_async, op)
            with self._lock:
                self._loading[op.req_id] = fut

    def _load_async(self, op: PageOp) -> None:
        try:
            good = self._load_checked(op)
        except Exception as err:  # never lose a request: it is reported finished and failed
            log.error("hicache-vllm: load of request %s failed: %s: %s", op.req_id, type(err).__name__, err)
            good = 0
        if good < len(op.hashes):  # recorded before the future is done: reported no later
            with self._lock:
                self._failed_reqs[op.req_id] = good

    def finished_loads(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose asynchronous load is over: done, or cancelled before it started
        because vLLM finished (aborted) the request. vLLM keeps an unreported request's blocks,
        so a load still running for an aborted request is waited for, never abandoned."""
        with self._lock:
            for r in finished_req_ids & self._loading.keys():
                self._loading[r].cancel()  # only succeeds if the load has not started
            done = {r for r, f in self._loading.items() if f.done()}
            for r in done:
                del self._loading[r]
        return done

    def failed_requests(self) -> dict[str, int]:
        """Asynchronous loads that failed since the last call: request id -> leading pages that
        were good (vLLM recomputes the request; the scheduler claims at most those again)."""
        with self._lock:
            out, self._failed_reqs = self._failed_reqs, {}
        return out

    def _load_one(self, op: PageOp) -> list[bool]:
        path, pool = self.path, self.pool
        if path is None or pool is None:
            return [False] * len(op.hashes)
        t0 = time.perf_counter()
        try:
            plan = Plan(PoolName.KV, pool, list(range(len(op.hashes))), list(op.block_ids))
            flags = path.get(Request(op.hashes), [plan])[PoolName.KV]
        except Exception as err:
            log.error("hicache-vllm: load of request %s failed: %s: %s", op.req_id, type(err).__name__, err)
            return [False] * len(op.hashes)
        good = flags.index(False) if False in flags else len(flags)
        self.stats.load_s += time.perf_counter() - t0
        self.stats.load_pages += good
        self.stats.load_bytes += good * pool.page_nbytes
        return flags

    def load_errors(self) -> set[int]:
        """Block ids that failed to load since the last call (vLLM recomputes them)."""
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def short_loads(self) -> dict[str, int]:
        """Synchronous loads that failed in part since the last call: request id -> leading
        pages that were good (the scheduler reports only those as cached)."""
        with self._lock:
            out, self._short_loads = self._short_loads, {}
        return out

    # ---------------------------------------------------------------- saves
    def save(self, ops: Sequence[PageOp]) -> None:
        """Write the pages of ``ops`` (skipping stored ones): now, or on the save thread.

        A step's saves are one transfer: every request's pages in one ``put`` (a page two
        requests of the step hold, same hash in two blocks, is written once, from the first)."""
        hashes: list[str] = []
        blocks: list[int] = []
        seen: set[str] = set()
        req_ids: list[str] = []
        for op in ops:
            req_ids.append(op.req_id)
            stop = len(op.hashes)
            if self._failed_step:
                stop = next((i for i, b in enumerate(op.block_ids) if b in self._failed_step), stop)
            for h, b in zip(op.hashes[:stop], op.block_ids[:stop]):
                if h not in seen:
                    seen.add(h)
                    hashes.append(h)
                    blocks.append(b)
        what = f"request {req_ids[0]}" if len(req_ids) == 1 else f"{len(req_ids)} requests"
        if self._saver is None:
            if hashes:
                self._save_one(hashes, blocks, what)
            return
        fut = self._saver.submit(self._save_one, hashes, blocks, what) if hashes else None
        with self._lock:  # the scheduler waits for these requests' reports (get_finished)
            for req_id in req_ids:
                pending = self._pending.setdefault(req_id, [])
                if fut is not None:
                    pending.append(fut)

    def _save_one(self, hashes: list[str], blocks: list[int], what: str) -> None:
        path, pool = self.path, self.pool
        if path is None or pool is None:
            return
        t0 = time.perf_counter()
        try:
            plan = Plan(PoolName.KV, pool, list(range(len(hashes))), blocks)
            flags, _ = path.put(Request(hashes), [plan])
            done = sum(flags[PoolName.KV])
        except Exception as err:
            log.error("hicache-vllm: save of %s failed: %s: %s", what, type(err).__name__, err)
            done = 0
        self.stats.save_s += time.perf_counter() - t0
        self.stats.save_pages += done
        self.stats.save_bytes += done * pool.page_nbytes
        self.stats.save_failed_pages += len(hashes) - done

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests vLLM finished (now or before) that were sent saves, those whose saves
        are all done. A request never sent a save is never reported: vLLM freed its blocks
        already (``request_finished`` answered False for it)."""
        with self._lock:
            self._finished_waiting |= finished_req_ids & self._pending.keys()
            done = {r for r in self._finished_waiting if all(f.done() for f in self._pending[r])}
            for r in done:
                self._pending.pop(r, None)
            self._finished_waiting -= done
        return done

    def drain(self) -> None:
        """Wait for every save in flight (before vLLM reuses the blocks of a preempted request)."""
        with self._lock:
            futures = [f for fs in self._pending.values() for f in fs]
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        if self._calls is not None:
            self._calls.shutdown()
        store, self.store, self.path = self.store, None, None
        if store is not None:
            store.close()
