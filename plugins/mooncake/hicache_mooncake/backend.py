"""``MooncakeBackend``: the hicache storage backend on the real Mooncake distributed store.

* v2 is zero-copy: every pool's buffers are registered in ``hicache_register_pool`` and a v2
  call moves all pools of a batch with ONE chunked ``batch_is_exist`` / ``batch_put_from`` /
  ``batch_get_into`` over ``(ptr, size)`` page components.
* v1 moves page-component views: registered contiguous views go direct, registered strided
  (``layer_first``) views use the multi-buffer calls, anything else goes through a registered
  bounce buffer.
* Standalone mode (``standalone_storage``) attaches to a separate ``mooncake_client`` with
  ``setup_dummy``; pool memory then comes from the store's shared pool through
  ``hicache_alloc_host_memory`` (the controller sizes it with
  :func:`hicache_core.sizing.standalone_required_bytes`). Opening only probes the client (typed
  timeout error within ``setup_timeout_s``); ``setup_dummy`` runs at that first allocation with
  ``mem_pool_size=nbytes``, or, when I/O or ``hicache_register_pool`` comes first (pools
  allocated outside the store), then with the ``mem_pool_size`` option (0: ``local_buffer_size``).
  A shared connection keeps the size of its first setup (normally the first opener's).
* Overwrite: Mooncake's ``put`` keeps the OLD value of an existing key. Pages are
  content-addressed, so by default an existing key is kept and reported stored; with
  ``overwrite=True`` every SET uses ``batch_upsert_from`` and replaces the stored bytes.
* Integrity: with Mooncake's object checksums on (option ``checksum``, process-wide) a get of a
  corrupt object is a miss, counted in :attr:`MooncakeBackend.integrity_errors` (read by the
  core's ``metrics`` extension), logged and removed so the next backup rewrites it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import add, mul
from typing import TYPE_CHECKING, Any

from hicache_core import (
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

from ._options import INSTALL_HINT, MooncakeOptions

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from hicache_core import HostPool, StorageConfig

__all__ = ["MooncakeBackend"]

log = logging.getLogger("hicache.mooncake")
_EXISTS, _SET = IoOp.EXISTS, IoOp.SET  # an enum member lookup costs a Python call (Python 3.11)


@dataclass
class _Pool:
    """A registered pool: its components' ``(base, page stride, page size)`` and zero-copy state."""

    pool: HostPool
    metas: list[tuple[int, int, int]]
    direct: bool  # page_first and every buffer inside registered memory


def _flat(values: Sequence[Sequence[Any]]) -> list[Any]:
    return list(chain.from_iterable(values))


def _flat_keys(rows: Sequence[Sequence[str]]) -> list[str]:
    """A transfer's keys, page by page. Rows of one key (one-component pools: MLA KV, indexer)
    are unpacked in one list comprehension, which takes a third of the time of chaining them."""
    try:
        return [k for (k,) in rows]
    except ValueError:  # a row with several components
        return list(chain.from_iterable(rows))


class MooncakeBackend:
    """Pages on a Mooncake cluster: embedded (``setup``) or standalone (``setup_dummy``)."""

    Options = MooncakeOptions
    capabilities = Capabilities(
        v1=True,
        v2=True,
        zero_copy=True,
        pools=frozenset(PoolName),
        persistent=False,
        shared=True,
        draft_io=DraftIoMode.ZERO_COPY_V2,
        # A put of an existing key is a no-op at the master (the old object is kept, no bytes
        # move), so backup needs no batch_is_exist round trip first; `overwrite` turns it off.
        set_skips_existing=True,
    )

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when ``mooncake.store`` can load, else why not and how to fix it.

        Cheap on purpose (listing calls it for every backend): importing ``mooncake.store``
        costs ~0.25 s, so this checks that the module is installed and that its one native
        dependency outside the wheel, ``libibverbs.so.1``, loads. Opening a store still
        imports the module and reports any other failure with the same install hint.
        """
        import importlib.machinery
        import importlib.util
        import os

        try:  # find_spec("mooncake.store") would execute mooncake/__init__ (which loads the store)
            spec = importlib.util.find_spec("mooncake")
        except (ImportError, ValueError):
            spec = None
        names = {f"store{suffix}" for suffix in importlib.machinery.all_suffixes()}
        places = (spec.submodule_search_locations or []) if spec is not None else []
        found = any(os.path.isfile(os.path.join(d, n)) for d in places for n in names)
        if not found:
            return f"cannot import mooncake.store (not installed); {INSTALL_HINT}"
        from _ctypes import dlopen  # what ctypes.CDLL calls; importing ctypes itself costs ~2 ms

        try:
            dlopen("libibverbs.so.1")
        except OSError as err:
            return f"cannot import mooncake.store ({err}); {INSTALL_HINT}"
        return None

    def __init__(self, config: StorageConfig, options: MooncakeOptions) -> None:
        self.config = config
        self.options = options
        if options.overwrite:  # SET replaces stored objects: backup must check existence first
            self.capabilities = dataclasses.replace(type(self).capabilities, set_skips_existing=False)
        from ._client import StoreLink  # the client modules load when a store is opened

        self.link = StoreLink(options, tp_rank=config.tp_rank, ranks=config.tp_size * config.pp_size)
        self._pools: dict[PoolName, _Pool] = {}
        self._staging: torch.Tensor | None = None
        self._staging_lock = threading.Lock()

    @property
    def integrity_errors(self) -> int:
        """Objects that failed Mooncake's checksum on a read of this store (misses, removed)."""
        return self.link.integrity_errors

    # ------------------------------------------------------------------ pools
    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> None:
        name = PoolName(pool_name)
        owner = f"pool:{name.value}"
        if name in self._pools:
            self.link.release(owner)
        registered = True
        for buf in pool.buffers():
            nbytes = buf.numel() * buf.element_size()
            registered &= self.link.register(buf.data_ptr(), nbytes, owner, buf)
        metas: list[tuple[int, int, int]] = []
        page_first = pool.layout is Layout.PAGE_FIRST
        if page_first:
            metas = [
                (b.data_ptr(), b.stride(0) * b.element_size(), n)
                for b, n in zip(pool.buffers(), pool.component_nbytes)
            ]
        if not registered:
            log.warning(
                "hicache mooncake: pool %r is not in memory the store can register (%s mode); its pages "
                "are copied through a bounce buffer. Build pools with allocate=False so the controller "
                "takes their memory from the store.",
                name.value,
                "standalone" if self.link.standalone else "embedded",
            )
        self._pools[name] = _Pool(pool, metas, registered and page_first)

    @hookimpl
    def hicache_alloc_host_memory(self, nbytes: int) -> torch.Tensor | None:
        if not self.link.standalone:
            return None  # embedded: plain torch memory, registered per pool
        # the first allocation runs the deferred setup_dummy with mem_pool_size=nbytes
        return self.link.alloc_shared(nbytes, owner="alloc", sizes_mapping=True)  # type: ignore[no-any-return]

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        if self.config.should_split_heads:
            return DraftIo(
                DraftIoMode.UNSUPPORTED,
                "should_split_heads=True: draft pages split across heads do not map to whole "
                "registered page components, so zero-copy v2 draft I/O is off",
            )
        return DraftIo(DraftIoMode.ZERO_COPY_V2, "draft pool registered and moved with the target pages")

    # --------------------------------------------------------------------- v2
    def _pool(self, name: PoolName) -> _Pool:
        try:
            return self._pools[name]
        except KeyError:
            raise PoolError(
                f"mooncake: pool {name.value!r} is not registered with this store (registered: "
                f"{[p.value for p in self._pools]}); attach it through CacheController first"
            ) from None

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        if type(op) is not IoOp:
            op = IoOp(op)
        if not transfers:
            return []
        # The hook may be called without the controller: each transfer's keys are flattened and
        # checked here once, and exactly that checked list goes to the client.
        flat_keys: list[list[str]] = []
        for t in transfers:
            tkeys = _flat_keys(t.keys)
            check_keys(tkeys)
            flat_keys.append(tkeys)
        if len(transfers) == 1 and op is not _EXISTS:  # the controller's usual call
            p = self._pools.get(transfers[0].pool)
            if p is not None and p.direct and len(p.metas) == 1:
                return [self._direct_one(op, transfers[0], p, flat_keys[0])]
        pools = [self._pool(t.pool) for t in transfers]
        for t, p, tkeys in zip(transfers, pools, flat_keys):
            if len(tkeys) != len(t) * len(p.pool.components):
                raise BatchShapeError(
                    f"mooncake: transfer for pool {t.pool.value!r} carries {len(t.keys)} key tuples with "
                    f"{len(tkeys)} keys for {len(t)} pages of {len(p.pool.components)} components; resolve "
                    "keys with store.page_keys() (CacheController does)"
                )
            hi = t.host_indices
            if op is not _EXISTS and hi and (min(hi) < 0 or max(hi) >= p.pool.num_pages):
                p.pool.check_indices(hi)  # raises BatchShapeError naming the bad index
        counts = [len(k) for k in flat_keys]
        if op is _EXISTS:
            flags = self.link.exists(_flat(flat_keys))
            return self._per_page(flags, pools, counts)
        keys: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        for t, p, k in zip(transfers, pools, flat_keys):
            if not p.direct or not k:
                continue
            keys += k
            if len(p.metas) == 1:
                ((base, stride, size),) = p.metas
                ptrs += [base + i * stride for i in t.host_indices]
                sizes += [size] * len(t)
            else:
                for i in t.host_indices:
                    for base, stride, size in p.metas:
                        ptrs.append(base + i * stride)
                        sizes.append(size)
        flags = (self.link.put if op is _SET else self.link.get)(keys, ptrs, sizes) if keys else []
        out: list[list[bool]] = []
        off = 0
        for t, p, k in zip(transfers, pools, flat_keys):
            n = len(k)
            if p.direct:
                part, off = flags[off : off + n], off + n
            else:  # not zero-copy capable: copy its page views through the bounce buffer
                views = _flat(p.pool.page_views(t.host_indices)) if n else []
                part = self._v1(op, k, views)
            out.append(self._group(part, len(p.pool.components)))
        return out

    def _direct_one(self, op: IoOp, t: PoolTransfer, p: _Pool, keys: list[str]) -> list[bool]:
        """SET / GET of one transfer of a zero-copy pool with one component: one store call
        with ``keys``, the transfer's checked keys.

        What the general path does for it, with the addresses computed in C-level loops: right
        after a transfer of megabytes the CPU caches are cold, and every Python step counts.
        """
        hi = t.host_indices
        n = len(hi)
        if len(keys) != n:
            raise BatchShapeError(
                f"mooncake: transfer for pool {t.pool.value!r} carries {len(t.keys)} key tuples with "
                f"{len(keys)} keys for {n} pages of 1 component; resolve keys with store.page_keys() "
                "(CacheController does)"
            )
        if not n:
            return []
        if min(hi) < 0 or max(hi) >= p.pool.num_pages:
            p.pool.check_indices(hi)  # raises BatchShapeError naming the bad index
        ((base, stride, size),) = p.metas
        ptrs = list(map(add, repeat(base, n), map(mul, hi, repeat(stride, n))))
        return (self.link.put if op is _SET else self.link.get)(keys, ptrs, [size] * n)

    def _per_page(self, flags: list[bool], pools: list[_Pool], counts: list[int]) -> list[list[bool]]:
        out, off = [], 0
        for p, n in zip(pools, counts):
            out.append(self._group(flags[off : off + n], len(p.pool.components)))
            off += n
        return out

    @staticmethod
    def _group(flags: list[bool], ncomp: int) -> list[bool]:
        if ncomp == 1:
            return flags
        return [all(flags[j : j + ncomp]) for j in range(0, len(flags), ncomp)]

    # --------------------------------------------------------------------- v1
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
        if op is IoOp.EXISTS:
            return self.link.exists(list(keys)) if keys else []
        if buffers is None or len(buffers) != len(keys):
            raise BatchShapeError(
                f"mooncake: {op.value} needs one buffer per key ({len(keys)} keys, "
                f"{'no' if buffers is None else len(buffers)} buffers)"
            )
        for b in buffers:
            if b.dtype.itemsize != 1 or b.device.type != "cpu":
                raise BatchShapeError(
                    f"mooncake: buffers must be torch.uint8 CPU views, got {b.dtype} on {b.device}"
                )
        return self._v1(op, list(keys), list(buffers))

    def _v1(self, op: IoOp, keys: list[str], views: list[torch.Tensor]) -> list[bool]:
        """Move views: direct when registered and contiguous, multi-range when strided, else bounced."""
        out = [False] * len(keys)
        d_idx: list[int] = []
        d_ptr: list[int] = []
        d_size: list[int] = []
        m_idx: list[int] = []
        m_ptr: list[list[int]] = []
        m_size: list[list[int]] = []
        s_idx: list[int] = []
        covers = self.link.covers
        for i, v in enumerate(views):
            n = v.numel()
            if n == 0:
                s_idx.append(i)
            elif v.is_contiguous():
                if covers(v.data_ptr(), n):
                    d_idx.append(i)
                    d_ptr.append(v.data_ptr())
                    d_size.append(n)
                else:
                    s_idx.append(i)
            elif (
                v.dim() == 2
                and v.stride(1) == 1
                and not (op is IoOp.SET and self.options.overwrite)  # no multi-range upsert
                and covers(v.data_ptr(), (v.shape[0] - 1) * v.stride(0) + v.shape[1])
            ):
                m_idx.append(i)
                m_ptr.append([v.data_ptr() + r * v.stride(0) for r in range(v.shape[0])])
                m_size.append([v.shape[1]] * v.shape[0])
            else:
                s_idx.append(i)
        if d_idx:
            fn = self.link.put if op is IoOp.SET else self.link.get
            for i, ok in zip(d_idx, fn([keys[i] for i in d_idx], d_ptr, d_size)):
                out[i] = ok
        if m_idx:
            fm = self.link.put_ranges if op is IoOp.SET else self.link.get_ranges
            for i, ok in zip(m_idx, fm([keys[i] for i in m_idx], m_ptr, m_size)):
                out[i] = ok
        if s_idx:
            for i, ok in zip(s_idx, self._bounced(op, [keys[i] for i in s_idx], [views[i] for i in s_idx])):
                out[i] = ok
        return out

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            import torch

            n = self.options.staging_buffer_size
            if self.link.standalone:
                self._staging = self.link.alloc_shared(n, owner="staging")
            else:
                buf = torch.empty(n, dtype=torch.uint8)
                if not self.link.register(buf.data_ptr(), n, "staging", buf):
                    raise BatchShapeError("mooncake: could not register the bounce buffer")
                self._staging = buf
        return self._staging

    def _bounced(self, op: IoOp, keys: list[str], views: list[torch.Tensor]) -> list[bool]:
        """Copy through the registered bounce buffer, in rounds that fit it."""
        out = [False] * len(keys)
        with self._staging_lock:
            stage = self._staging_buffer()
            cap = stage.numel()
            i = 0
            while i < len(keys):
                batch: list[int] = []
                offs: list[int] = []
                used = 0
                while i < len(keys) and used + views[i].numel() <= cap:
                    if views[i].numel() == 0:
                        i += 1  # an empty object cannot be stored
                        continue
                    batch.append(i)
                    offs.append(used)
                    used += (views[i].numel() + 63) // 64 * 64
                    i += 1
                if not batch:
                    if i < len(keys):
                        log.warning(
                            "hicache mooncake: a %d-byte view exceeds staging_buffer_size=%d; raise it",
                            views[i].numel(),
                            cap,
                        )
                        i += 1
                    continue
                base = stage.data_ptr()
                ptrs = [base + o for o in offs]
                sizes = [views[j].numel() for j in batch]
                slots = [stage[o : o + s] for o, s in zip(offs, sizes)]
                if op is IoOp.SET:
                    for j, slot in zip(batch, slots):
                        slot.view(views[j].shape).copy_(views[j])
                    res = self.link.put([keys[j] for j in batch], ptrs, sizes)
                else:
                    res = self.link.get([keys[j] for j in batch], ptrs, sizes)
                    for j, slot, ok in zip(batch, slots, res):
                        if ok:
                            views[j].copy_(slot.view(views[j].shape))
                for j, ok in zip(batch, res):
                    out[j] = ok
        return out

    # ------------------------------------------------------------------ admin
    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        return self.link.remove_prefix(namespace + ".")

    @hookimpl
    def hicache_close(self) -> None:
        self._pools.clear()
        self.link.close()

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.link.where}, pools={[p.value for p in self._pools]})"
