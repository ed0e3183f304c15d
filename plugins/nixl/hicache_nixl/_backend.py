"""``NixlBackend``: hicache pages through NIXL's POSIX (files) or OBJ (S3) plugin.

* ``hicache_register_pool`` registers every buffer of a pool with NIXL once (DRAM); a second
  registration of a name releases the first.
* v1 and v2 describe each page component as DRAM segments of the pool: one ``(ptr, size)`` for
  a ``page_first`` page, one per layer row for a ``layer_first`` one. With the POSIX plugin NIXL
  moves them straight between pool memory and the files (zero-copy, both layouts); memory that
  is not registered (a staged store's own buffers) goes through a buffer registered for the
  call. The OBJ plugin writes whole objects only, so its pages are copied through a staging
  buffer next to their header (``_obj``); it narrows ``zero_copy`` off.
* Every batch is one NIXL transfer (POSIX: into one new segment, published by one index record;
  a read of 8 MiB or more in up to 8 parts, each checksummed while the next moves);
  when NIXL reports it failed, each page component is retried alone (POSIX) or checked for
  existence (OBJ), so a failure is reported per page.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hicache_core import (
    BackendIOError,
    BatchShapeError,
    Capabilities,
    DraftIo,
    DraftIoMode,
    IoOp,
    Layout,
    PoolError,
    PoolName,
    PoolTransfer,
    check_keys,
    hookimpl,
)

from ._agent import Agent, availability, check_engine
from ._options import NixlOptions

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from hicache_core import HostPool, StorageConfig

    from ._obj import ObjStore
    from ._posix import Item, PosixStore

__all__ = ["NixlBackend"]

log = logging.getLogger("hicache.nixl")
_ALIGN = 4096


def segments(view: torch.Tensor) -> list[tuple[int, int]] | None:
    """``(address, length)`` runs of a uint8 view in order, or ``None`` when it has no simple shape."""
    n = view.numel()
    if n == 0:
        return []
    if view.is_contiguous():
        return [(view.data_ptr(), n)]
    if view.dim() == 2 and view.stride(1) == 1:
        p, s, w = view.data_ptr(), view.stride(0), view.shape[1]
        return [(p + r * s, w) for r in range(view.shape[0])]
    return None


class NixlBackend:
    """Pages as files (NIXL POSIX plugin) or S3 objects (NIXL OBJ plugin), one per component key."""

    Options = NixlOptions
    capabilities = Capabilities(
        v1=True,
        v2=True,
        zero_copy=True,
        pools=frozenset(PoolName),
        persistent=True,
        shared=True,
        draft_io=DraftIoMode.ZERO_COPY_V2,
        set_skips_existing=True,  # a SET of a stored key keeps it (content-addressed pages)
    )

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when NIXL is installed (found, not imported: listing stays fast)."""
        return availability()

    def __init__(self, config: StorageConfig, options: NixlOptions) -> None:
        self.config = config
        self.options = options
        self.store: PosixStore | ObjStore
        if options.plugin == "posix":
            from ._posix import PosixStore  # the store's engine modules load when one is opened

            self.agent = self._posix_agent(options)
            self.store = PosixStore(self.agent, options.resolved_root(), options.o_direct, options.fsync)
        else:
            from ._obj import ObjStore, shared_agent

            self.agent = shared_agent(options)
            self.store = ObjStore(self.agent, options)
            self.capabilities = dataclasses.replace(
                type(self).capabilities, zero_copy=False, draft_io=DraftIoMode.GENERIC
            )
        self._pools: dict[PoolName, HostPool] = {}
        self._regs: dict[PoolName, Any] = {}
        self._regions: list[tuple[int, int]] = []  # registered DRAM [start, end), sorted
        self._lock = threading.Lock()

    @staticmethod
    def _posix_agent(options: NixlOptions) -> Agent:
        """An agent with the POSIX plugin on the chosen engine (io_uring refused: aio, logged)."""
        agent = Agent(options.timeout_s)
        key = check_engine(agent.plugin_params("POSIX"), options.engine)
        try:
            agent.create("POSIX", {"use_aio": "false", "use_uring": "false", key: "true"})
        except BackendIOError as err:
            if options.engine != "uring":
                raise
            log.warning("hicache nixl: io_uring was refused here (%s); falling back to engine='aio'", err)
            agent.create("POSIX", {"use_aio": "true", "use_uring": "false"})
        return agent

    @property
    def integrity_errors(self) -> int:
        """Objects that failed their checksum on a read of this store (misses)."""
        return self.store.integrity_errors

    # ------------------------------------------------------------------ pools
    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> None:
        from ._posix import PosixStore

        name = PoolName(pool_name)
        with self._lock:
            old = self._regs.pop(name, None)
            if old is not None:
                self.agent.deregister(old)
            self._pools.pop(name, None)
            items = []
            for buf in pool.buffers():
                n = buf.numel() * buf.element_size()
                if n:
                    items.append((buf.data_ptr(), n, 0, ""))
            if items and isinstance(self.store, PosixStore):  # OBJ copies through its own staging
                self._regs[name] = self.agent.register(items, "DRAM")
            self._pools[name] = pool
            spans = {(a, a + n) for reg_pool in self._pools.values() for a, n in _spans(reg_pool)}
            self._regions = sorted(spans)

    def _registered(self, segs: Sequence[tuple[int, int]]) -> bool:
        regions = self._regions
        for a, n in segs:
            i = bisect.bisect_right(regions, (a, float("inf"))) - 1
            if i < 0 or a + n > regions[i][1]:
                return False
        return True

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        if self.options.plugin == "obj":
            return DraftIo(
                DraftIoMode.GENERIC, "obj copies every page through a staging buffer: draft pages over v1"
            )
        if self.config.should_split_heads:
            return DraftIo(
                DraftIoMode.GENERIC,
                "should_split_heads=True: draft pages are copied over v1 under their own keys instead of zero-copy v2",
            )
        return DraftIo(
            DraftIoMode.ZERO_COPY_V2, "draft pool registered with NIXL and moved with the target pages"
        )

    # --------------------------------------------------------------------- I/O
    def _run(self, op: IoOp, keys: Sequence[str], views: Sequence[torch.Tensor]) -> list[bool]:
        """SET or GET of ``views`` under ``keys``: zero-copy where registered, else through a buffer."""
        import torch

        from ._posix import Item, PosixStore

        posix = isinstance(self.store, PosixStore)
        items: list[Item | None] = []
        bounce: list[tuple[int, torch.Tensor, int]] = []
        size = 0
        for i, (key, v) in enumerate(zip(keys, views)):
            n = v.numel()
            segs = segments(v)
            if segs is None or (posix and segs and not self._registered(segs)):
                bounce.append((i, v, size))
                size += -(-n // _ALIGN) * _ALIGN
                items.append(None)
            else:
                items.append(Item(key, segs, n))
        arena = None
        reg = None
        if bounce:
            from ._format import aligned_empty

            arena = aligned_empty(size)
            flat = torch.from_numpy(arena)
            base = arena.ctypes.data
            for i, v, off in bounce:
                n = v.numel()
                if op is IoOp.SET:
                    flat[off : off + n].view(v.shape).copy_(v)
                items[i] = Item(keys[i], [(base + off, n)] if n else [], n)
            if posix and size:
                reg = self.agent.register([(base, size, 0, "")], "DRAM")
        before = len(self.agent.abandoned)
        try:
            ready = [it for it in items if it is not None]
            flags = (self.store.put if op is IoOp.SET else self.store.get)(ready)
        finally:
            if len(self.agent.abandoned) > before and arena is not None:
                self.agent.abandoned.append(arena)  # a transfer was given up: NIXL may still use it
            elif reg is not None:
                self.agent.deregister(reg)
        if op is IoOp.GET and arena is not None:
            flat = torch.from_numpy(arena)
            for i, v, off in bounce:
                if flags[i]:
                    v.copy_(flat[off : off + v.numel()].view(v.shape))
        return flags

    def _direct(self, pool: HostPool) -> bool:
        """Whether the pages of ``pool`` are described straight from its ``page_meta``: a
        ``page_first`` pool whose buffers are registered with the posix agent as they are now."""
        from ._posix import PosixStore

        return (
            isinstance(self.store, PosixStore)
            and pool.layout is Layout.PAGE_FIRST
            and any(p is pool for p in self._pools.values())
            and self._registered(_spans(pool))
        )

    def _direct_io(
        self, op: IoOp, plans: Sequence[tuple[tuple[str, ...], HostPool, Sequence[int]]]
    ) -> list[bool]:
        """SET or GET of registered ``page_first`` pages, one run of pool memory per component (no
        tensor view per page: ``page_meta`` gives the addresses)."""
        from ._posix import Item, PosixStore

        items = []
        for keys, pool, indices in plans:
            it = iter(keys)
            for page in pool.page_meta(indices):
                for addr, n in page:
                    items.append(Item(next(it), [(addr, n)] if n else [], n))
        store = self.store
        assert isinstance(store, PosixStore)
        return store.put(items) if op is IoOp.SET else store.get(items)

    @hookimpl
    def hicache_batch_io_v1(
        self,
        op: IoOp,
        keys: Sequence[str],
        buffers: Sequence[torch.Tensor] | None,
        pool_name: PoolName | None = None,  # unused (pluggy does not pass it): for direct calls
    ) -> list[bool]:
        op = IoOp(op)
        keys = tuple(keys)  # checked and used: the same immutable batch
        check_keys(keys)
        if not keys:
            return []
        if op is IoOp.EXISTS:
            return self.store.exists(keys)
        if buffers is None or len(buffers) != len(keys):
            raise BatchShapeError(
                f"nixl: {op.value} needs one buffer per key ({len(keys)} keys, "
                f"{'no' if buffers is None else len(buffers)} buffers)"
            )
        for b in buffers:
            if b.dtype.itemsize != 1 or b.device.type != "cpu":
                raise BatchShapeError(
                    f"nixl: buffers must be torch.uint8 CPU views, got {b.dtype} on {b.device}"
                )
        return self._run(op, keys, list(buffers))

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        op = IoOp(op)
        if not transfers:
            return []
        plans = []
        for t in transfers:
            keys = tuple(k for page in t.keys for k in page)
            check_keys(keys)  # the hook may be called without the controller
            pool = self._pools.get(PoolName(t.pool))
            if pool is None:
                raise PoolError(
                    f"nixl: pool {PoolName(t.pool).value!r} is not registered with this store (registered: "
                    f"{[p.value for p in self._pools]}); attach it through CacheController first"
                )
            ncomp = len(pool.components)
            if len(t.keys) != len(t.host_indices) or len(keys) != len(t.host_indices) * ncomp:
                raise BatchShapeError(
                    f"nixl: transfer for pool {pool_label(t)} carries {len(t.keys)} key tuples with {len(keys)} keys "
                    f"for {len(t.host_indices)} pages of {ncomp} components; resolve keys with store.page_keys() "
                    "(CacheController does)"
                )
            plans.append((keys, pool, t.host_indices, ncomp))
        all_keys = [k for keys, _, _, _ in plans for k in keys]
        if not all_keys:
            flags: list[bool] = []
        elif op is IoOp.EXISTS:
            flags = self.store.exists(all_keys)
        elif all(self._direct(pool) for _, pool, _, _ in plans):
            flags = self._direct_io(op, [(keys, pool, idx) for keys, pool, idx, _ in plans])
        else:
            views = [v for _, pool, idx, _ in plans for page in pool.page_views(idx) for v in page]
            flags = self._run(op, all_keys, views)
        out: list[list[bool]] = []
        off = 0
        for keys, _, _, ncomp in plans:
            part, off = flags[off : off + len(keys)], off + len(keys)
            out.append([all(part[j : j + ncomp]) for j in range(0, len(part), ncomp)])
        return out

    # ------------------------------------------------------------------ admin
    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        check_keys([namespace])
        return self.store.clear(namespace)

    @hookimpl
    def hicache_close(self) -> None:
        with self._lock:
            for reg in self._regs.values():
                self.agent.deregister(reg)
            self._regs.clear()
            self._pools.clear()
            self._regions = []
        self.store.close()
        self.agent.close()

    def __repr__(self) -> str:
        where = (
            self.options.resolved_root() if self.options.plugin == "posix" else f"s3://{self.options.bucket}"
        )
        return f"NixlBackend({self.options.plugin}, {where}, pools={[p.value for p in self._pools]})"


def pool_label(t: PoolTransfer) -> str:
    return repr(PoolName(t.pool).value)


def _spans(pool: HostPool) -> list[tuple[int, int]]:
    return [(b.data_ptr(), b.numel() * b.element_size()) for b in pool.buffers()]
