"""An in-memory backend used by the core's own tests (never shipped).

Module-level knobs let a test declare any capability; subclasses in tests adjust them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict

from hicache_core import (
    Capabilities,
    DraftIo,
    DraftIoMode,
    IoOp,
    PoolName,
    PoolTransfer,
    check_keys,
    hookimpl,
)

SHARED: dict[str, bytes] = {}


class MemoryBackend:
    """Stores each key's bytes in a dict shared by every instance in the process."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        fail_pools: list[str] = []
        raise_on: list[str] = []
        raise_ops: list[str] = []  # v2 calls of these ops ("exists", "set", "get") raise
        fail_every: int = 0  # v2 SET / GET report every k-th page of a transfer failed (k > 0)
        stray_get_write: bool = False  # a v2 GET also zeroes the host page after the last one read

    capabilities = Capabilities(
        v1=True, v2=True, persistent=False, shared=False, draft_io=DraftIoMode.GENERIC
    )
    draft_mode = DraftIoMode.GENERIC

    def __init__(self, config, options) -> None:
        self.config = config
        self.options = options
        self.data = SHARED
        self.pools: dict[PoolName, object] = {}
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, int]] = []

    @hookimpl
    def hicache_register_pool(self, pool_name, pool) -> None:
        self.pools[pool_name] = pool

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        mode = self.draft_mode
        if self.config.should_split_heads and mode is DraftIoMode.ZERO_COPY_V2:
            return DraftIo(DraftIoMode.UNSUPPORTED, "split heads")
        return DraftIo(mode, "memory backend")

    def _io(self, op: IoOp, keys: Sequence[str], buffers) -> list[bool]:
        check_keys(keys)  # the hooks may be called directly: refuse unsafe keys (KeyFormatError)
        out = []
        with self.lock:
            for i, key in enumerate(keys):
                if op is IoOp.EXISTS:
                    out.append(key in self.data)
                elif op is IoOp.SET:
                    self.data[key] = buffers[i].contiguous().numpy().tobytes()
                    out.append(True)
                else:
                    blob = self.data.get(key)
                    if blob is None or len(blob) != buffers[i].numel():
                        out.append(False)
                        continue
                    buffers[i].copy_(
                        torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(buffers[i].shape)
                    )
                    out.append(True)
        return out

    @hookimpl
    def hicache_batch_io_v1(self, op, keys, buffers) -> list[bool]:
        self.calls.append(("v1", str(op), len(keys)))
        if "v1" in self.options.raise_on or str(op) in self.options.raise_on:
            raise RuntimeError("injected v1 failure")
        return self._io(op, keys, buffers)

    @hookimpl
    def hicache_batch_io_v2(self, op, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        self.calls.append(("v2", str(op), sum(len(t) for t in transfers)))
        results = []
        if IoOp(op).value in self.options.raise_ops:
            raise RuntimeError(f"injected {IoOp(op).value} failure")
        for t in transfers:
            if t.pool.value in self.options.raise_on:
                raise RuntimeError(f"injected failure on pool {t.pool.value}")
            if t.pool.value in self.options.fail_pools:
                results.append([False] * len(t))
                continue
            pool = self.pools[t.pool]
            views = pool.page_views(t.host_indices) if op is not IoOp.EXISTS else [()] * len(t)
            page_ok = []
            k = self.options.fail_every
            for i, (keys, v) in enumerate(zip(t.keys, views)):
                if k and op is not IoOp.EXISTS and i % k == k - 1:
                    page_ok.append(False)
                    continue
                flags = self._io(op, keys, v if op is not IoOp.EXISTS else None)
                page_ok.append(all(flags))
            results.append(page_ok)
            if self.options.stray_get_write and op is IoOp.GET and len(t):
                after = max(t.host_indices) + 1
                if after < pool.num_pages:
                    for view in pool.page_views([after])[0]:
                        view.zero_()
        return results

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        with self.lock:
            gone = [k for k in self.data if k.startswith(namespace + ".")]
            for k in gone:
                del self.data[k]
        return len(gone)


class ZeroCopyMemoryBackend(MemoryBackend):
    """Declares zero-copy v2 and draft ``zero_copy_v2`` (split heads -> unsupported)."""

    capabilities = Capabilities(v1=True, v2=True, zero_copy=True, draft_io=DraftIoMode.ZERO_COPY_V2)
    draft_mode = DraftIoMode.ZERO_COPY_V2


class NoDraftMemoryBackend(MemoryBackend):
    """v1 only, KV only, draft unsupported."""

    capabilities = Capabilities(
        v1=True, v2=False, pools=frozenset({PoolName.KV}), draft_io=DraftIoMode.UNSUPPORTED
    )
    draft_mode = DraftIoMode.UNSUPPORTED


class SkippingMemoryBackend(MemoryBackend):
    """SET keeps an object that is already stored (``set_skips_existing``); with the
    ``overwrite`` option it replaces it and narrows its capabilities, as Mooncake's does."""

    class Options(MemoryBackend.Options):
        overwrite: bool = False

    capabilities = dataclasses.replace(MemoryBackend.capabilities, set_skips_existing=True)

    def __init__(self, config, options) -> None:
        super().__init__(config, options)
        self.overwrite = options.overwrite
        if self.overwrite:
            self.capabilities = dataclasses.replace(type(self).capabilities, set_skips_existing=False)

    def _io(self, op: IoOp, keys: Sequence[str], buffers) -> list[bool]:
        if op is IoOp.SET and not self.overwrite:
            with self.lock:
                new = [i for i, k in enumerate(keys) if k not in self.data]
            out = super()._io(op, [keys[i] for i in new], [buffers[i] for i in new]) if new else []
            return [True] * len(keys) if all(out) else [k in self.data for k in keys]
        return super()._io(op, keys, buffers)


class WideningMemoryBackend(MemoryBackend):
    """Declares v1 only on the class, then claims v2 on the instance (a contract error)."""

    capabilities = dataclasses.replace(MemoryBackend.capabilities, v2=False)

    def __init__(self, config, options) -> None:
        super().__init__(config, options)
        self.capabilities = dataclasses.replace(type(self).capabilities, v2=True)


MEMORY_ENTRY_POINTS = {
    "memory": "tests.support.membackend:MemoryBackend",
    "memory-skip": "tests.support.membackend:SkippingMemoryBackend",
    "memory-widen": "tests.support.membackend:WideningMemoryBackend",
    "memory-zc": "tests.support.membackend:ZeroCopyMemoryBackend",
    "memory-nodraft": "tests.support.membackend:NoDraftMemoryBackend",
}
