"""Broken examples written from the contract's rules alone, before the rule tests existed.

Each class breaks ONE rule of CONTRIBUTING.md's backend contract (its docstring quotes it, with the
rule id) that the suite did not check when the example was written: every one of them passed the
whole suite of that day (the record is in ``broken_backends.py``, section "rules"). They are
the defects of a third-party author who read the contract quickly: other store instances,
processes and ranks, every pool kind, batch order and repetition, reopening after a crash, and
``clear`` seen from another store. See ``broken_backends.py`` for the registry.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from hicache_core import Capabilities, DraftIoMode, IoOp, PoolName, PoolTransfer, check_keys, hookimpl

from .broken_backends import LOCK, GoodMemory, as_bytes, copy_into
from .broken_backends_file import GoodFile


# --------------------------------------------------------------- other stores, other processes
class NegativeExistsCache(GoodFile):
    """EXISTS remembers the keys it found absent (a per-store negative cache, to save lookups) and
    forgets one only when this store sets it: a page another store (or process) publishes later
    stays invisible to this store's EXISTS and ``query``.

    Breaks: R30 "`shared`: pages written by one store are visible, through exists, get, query and
    prefetch, to every other store opened on the same options".
    """

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.absent: set[str] = set()

    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> list[bool]:
        if op is not IoOp.EXISTS:
            if op is IoOp.SET:
                self.absent.difference_update(keys)
            return super().hicache_batch_io_v1(op, keys, buffers, pool_name)
        self.check(keys)
        out = [key not in self.absent and (self.root / key).is_file() for key in keys]
        self.absent.update(k for k, found in zip(keys, out) if not found)
        return out

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        self.absent.clear()
        return super().hicache_clear(namespace)


class ClearOwnWritesOnly(GoodFile):
    """``hicache_clear`` removes the keys of the namespace that this store instance wrote (it
    tracks them), not those written by another store, another process or before a reopen.

    Breaks: R26 "`hicache_clear(namespace)` removes every object whose key starts with
    `namespace + "."`: in every pool, whichever store or process wrote it".
    """

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.written: set[str] = set()

    def _put(self, key: str, buf: torch.Tensor) -> bool:
        self.written.add(key)
        return super()._put(key, buf)

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        removed = 0
        for key in [k for k in self.written if k.startswith(namespace + ".")]:
            path = self.root / key
            if path.is_file():
                path.unlink()
                removed += 1
            self.written.discard(key)
        return removed


class CacheSurvivesForeignClear(GoodFile):
    """GET is served from a per-store read cache, dropped by this store's own SET and clear; a
    clear made through another store (or process) on the same storage leaves it in place, so
    this store still serves cleared pages.

    Breaks: R27 "After a clear, no store on that storage reports or serves a cleared page (no
    cache may answer for it) until it is set again".
    """

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.cache: dict[str, bytes] = {}

    def _put(self, key: str, buf: torch.Tensor) -> bool:
        self.cache.pop(key, None)
        return super()._put(key, buf)

    def _get(self, key: str, buf: torch.Tensor) -> bool:
        blob = self.cache.get(key)
        if blob is None:
            try:
                blob = (self.root / key).read_bytes()
            except FileNotFoundError:
                return False
            self.cache[key] = blob
        if len(blob) != buf.numel():
            return False
        copy_into(buf, blob)
        return True

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        for key in [k for k in self.cache if k.startswith(namespace + ".")]:
            del self.cache[key]
        return super().hicache_clear(namespace)


class IndexLostUpdate(GoodFile):
    """Pages are files, published by a shared index file (``index.json``: the keys stored) that
    SET and clear rewrite by read-modify-write under a thread lock, not a lock other processes
    honour: when two processes (two ranks) set pages at the same time, one's index update
    overwrites the other's and pages reported ``True`` vanish.

    Breaks: R31 "Processes (such as the ranks of one model) that set pages on shared storage at
    the same time never lose each other's pages: every page any of them set is visible afterwards".
    """

    lock = threading.Lock()

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.index_path = self.root / "index.json"

    def _index(self) -> set[str]:
        try:
            return set(json.loads(self.index_path.read_text()))
        except FileNotFoundError:
            return set()

    def _save(self, keys: set[str]) -> None:
        tmp = self.root / f".index.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps(sorted(keys)))
        os.replace(tmp, self.index_path)

    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> list[bool]:
        self.check(keys)
        if op is IoOp.SET:
            assert buffers is not None
            out = [self._put(k, b) for k, b in zip(keys, buffers)]
            with self.lock:
                index = self._index()
                index.update(k for k, ok in zip(keys, out) if ok)
                self._save(index)
            return out
        index = self._index()
        if op is IoOp.EXISTS:
            return [k in index and (self.root / k).is_file() for k in keys]
        assert buffers is not None
        return [k in index and self._get(k, b) for k, b in zip(keys, buffers)]

    def _put(self, key: str, buf: torch.Tensor) -> bool:
        path = self.root / key
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        self.write(tmp, as_bytes(buf))
        os.replace(tmp, path)
        return True

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        with self.lock:
            index = self._index()
            gone = {k for k in index if k.startswith(namespace + ".")}
            self._save(index - gone)
        for key in gone:
            (self.root / key).unlink(missing_ok=True)
        return len(gone)


# ------------------------------------------------------------------------ persistence
PENDING: dict[str, dict[str, bytes]] = {}  # root -> key -> bytes not yet written (process-wide)


class WriteBackUntilClose(GoodFile):
    """Declares ``persistent`` (not ``shared``). SET keeps pages in a process-wide write-back
    table that every store of this process reads, and writes them to files when a store closes:
    reopening after a clean close finds every page, but pages set by a process that ends without
    closing its store (killed, crashed) are lost although SET reported them ``True``.

    Breaks: R29 "A `persistent` backend's SET is durable: a page reported `True` survives the
    process that wrote it ending without closing its store".
    """

    capabilities = Capabilities(
        v1=True, v2=False, persistent=True, shared=False, draft_io=DraftIoMode.GENERIC
    )

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        with LOCK:
            self.pending = PENDING.setdefault(str(self.root), {})

    def _put(self, key: str, buf: torch.Tensor) -> bool:
        with LOCK:
            self.pending[key] = as_bytes(buf)
        return True

    def _get(self, key: str, buf: torch.Tensor) -> bool:
        with LOCK:
            blob = self.pending.get(key)
        if blob is None:
            return super()._get(key, buf)
        if len(blob) != buf.numel():
            return False
        copy_into(buf, blob)
        return True

    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> list[bool]:
        if op is IoOp.EXISTS:
            self.check(keys)
            with LOCK:
                return [k in self.pending or (self.root / k).is_file() for k in keys]
        return super().hicache_batch_io_v1(op, keys, buffers, pool_name)

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        with LOCK:
            gone = [k for k in self.pending if k.startswith(namespace + ".")]
            for k in gone:
                del self.pending[k]
        return len(gone) + super().hicache_clear(namespace)

    @hookimpl
    def hicache_close(self) -> None:
        with LOCK:
            for key, blob in list(self.pending.items()):
                tmp = self.root / f".{key}.{os.getpid()}.tmp"
                tmp.write_bytes(blob)
                os.replace(tmp, self.root / key)
            self.pending.clear()


class SidecarPoolsInMemory(GoodFile):
    """Declares ``persistent`` and ``shared`` for every pool, but only KV pages are files: the
    pages of the other pools (Mamba, indexer, draft) are kept in the store object's memory, lost
    on reopen and invisible to other stores.

    Breaks: R28 "`persistent`: the pages of every pool the backend declares survive closing the
    store and opening a new one on the same options".
    """

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.sidecar: dict[str, bytes] = {}

    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> list[bool]:
        if pool_name is PoolName.KV:
            return super().hicache_batch_io_v1(op, keys, buffers, pool_name)
        check_keys(keys)
        if op is IoOp.EXISTS:
            return [k in self.sidecar for k in keys]
        assert buffers is not None
        if op is IoOp.SET:
            self.sidecar.update((k, as_bytes(b)) for k, b in zip(keys, buffers))
            return [True] * len(keys)
        out = []
        for key, buf in zip(keys, buffers):
            blob = self.sidecar.get(key)
            if blob is None or len(blob) != buf.numel():
                out.append(False)
                continue
            copy_into(buf, blob)
            out.append(True)
        return out

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        gone = [k for k in self.sidecar if k.startswith(namespace + ".")]
        for k in gone:
            del self.sidecar[k]
        return len(gone) + super().hicache_clear(namespace)


# --------------------------------------------------------------------------- pools, clear
class ClearKvOnly(GoodMemory):
    """``hicache_clear`` removes the namespace's KV pages only: Mamba, indexer and draft pages
    of the namespace stay stored (it keeps each pool in a table and forgets the others).

    Breaks: R26 "`hicache_clear(namespace)` removes every object whose key starts with
    `namespace + "."`: in every pool, whichever store or process wrote it".
    """

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        with LOCK:
            gone = [k for k in self.data if k.startswith(f"{namespace}.{PoolName.KV.value}.")]
            for k in gone:
                del self.data[k]
        return len(gone)


class SidecarIgnoresStrides(GoodMemory):
    """SET of the pools other than KV reads each buffer as ``numel`` contiguous bytes from its
    first element (it assumes only KV pools may be ``layer_first``): Mamba, indexer and draft
    pages of ``layer_first`` pools are stored with the wrong bytes.

    Breaks: R6 "A backend stores every pool kind it declares in `capabilities.pools`, on both
    layouts (`page_first` and `layer_first`), on every I/O path it declares".
    """

    @staticmethod
    def _flat(buffers: Sequence[torch.Tensor] | None) -> list[torch.Tensor] | None:
        if buffers is None:
            return None
        return [b.as_strided((b.numel(),), (1,)) if not b.is_contiguous() else b for b in buffers]

    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> list[bool] | None:
        if op is IoOp.SET and pool_name is not PoolName.KV:
            buffers = self._flat(buffers)
        return super().hicache_batch_io_v1(op, keys, buffers)

    def transfer_io(self, op: IoOp, t: PoolTransfer) -> list[bool]:
        if op is not IoOp.SET or t.pool is PoolName.KV:
            return super().transfer_io(op, t)
        check_keys([key for keys in t.keys for key in keys])
        views = self.pools[t.pool].page_views(t.host_indices)
        return [self.page_io(op, keys, self._flat(page)) for keys, page in zip(t.keys, views)]


# ---------------------------------------------------------------- batch order, repetition
class DedupesRepeatedKeys(GoodMemory):
    """GET copies each distinct key once: a key repeated in one batch gets its bytes in the first
    buffer only, and the later positions report ``True`` with their buffers untouched.

    Breaks: R8 "Results are positional: result `i` answers input `i` [...] whatever the order of
    the keys, pages and transfers, and when a key or page repeats in a GET or EXISTS batch".
    """

    def io(self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None) -> list[bool] | None:
        if op is not IoOp.GET:
            return super().io(op, keys, buffers)
        assert buffers is not None
        seen: dict[str, bool] = {}
        out = []
        with LOCK:
            for key, buf in zip(keys, buffers):
                if key not in seen:
                    seen[key] = self.get(key, buf)
                out.append(seen[key])
        return out


class V2SortsHostIndices(GoodMemory):
    """v2 takes the host slots of the pools other than KV in ascending order (it sorts them, to
    copy runs of neighbouring slots), but keeps the pages in the order given: when a Mamba,
    indexer or draft transfer names its slots out of order, pages land in each other's slots.

    Breaks: R8 "Results are positional: result `i` answers input `i` (for v2, `host_indices[i]` is
    the host slot of page `i`), whatever the order of the keys, pages and transfers".
    """

    def transfer_io(self, op: IoOp, t: PoolTransfer) -> list[bool]:
        if op is IoOp.EXISTS or t.pool is PoolName.KV:
            return super().transfer_io(op, t)
        check_keys([key for keys in t.keys for key in keys])
        views = self.pools[t.pool].page_views(sorted(t.host_indices))
        return [self.page_io(op, keys, page) for keys, page in zip(t.keys, views)]


class V2ResultsByPool(GoodMemory):
    """v2 collects its answers in a dict keyed by pool: when one call carries two transfers of the
    same pool, both slots get the answer of the last one.

    Breaks: R8 "one list per `PoolTransfer`, one bool per page [...] result `i` answers input
    `i` [...] whatever the order of the keys, pages and transfers".
    """

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]] | None:
        by_pool = {t.pool: self.transfer_io(op, t) if len(t) else [] for t in transfers}
        return [
            list(by_pool[t.pool]) if len(by_pool[t.pool]) == len(t) else [False] * len(t) for t in transfers
        ]


class V2ResultsInPoolOrder(GoodMemory):
    """v2 answers the transfers in the order its pools were registered (KV first), not in the
    order of the call: a call listing a Mamba or indexer transfer before the KV one gets the
    answers swapped.

    Breaks: R8 "one list per `PoolTransfer`, one bool per page [...] result `i` answers input
    `i` [...] whatever the order of the keys, pages and transfers".
    """

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]] | None:
        rank = {name: i for i, name in enumerate(self.pools)}
        ordered = sorted(transfers, key=lambda t: rank.get(t.pool, len(rank)))
        answers = [self.transfer_io(op, t) if len(t) else [] for t in ordered]
        sizes = [len(t) for t in transfers]
        out = []
        for t, size in zip(answers, sizes):  # answers in pool order, slots in call order
            out.append(list(t[:size]) + [False] * (size - len(t)))
        return out
