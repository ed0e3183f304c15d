"""Broken examples of the copying I/O path (mostly v1) and of the hooks' result shapes.

Each class changes one behaviour of ``GoodMemory`` (``broken_backends.py``, which also holds the
registry of every example and the suite tests that must catch it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache_core import Capabilities, DraftIoMode, IoOp, PoolTransfer, hookimpl

from .broken_backends import LOCK, GoodMemory, copy_into


class ReadCacheSurvivesClear(GoodMemory):
    """GET is served from a per-store read cache (filled by GET, invalidated by SET) that
    ``hicache_clear`` forgets to drop: a page read before ``clear()`` is still a hit after it.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_clear``: "Remove every object whose key starts with
    `namespace + "."`"; ``hicache_batch_io_v1``: "`GET` the buffer now holds the stored bytes
    (a stored object of another size is `False` [...] the page is never reported loaded)".
    """

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.cache: dict[str, bytes] = {}

    def put(self, key: str, buf: torch.Tensor) -> bool:
        self.cache.pop(key, None)
        return super().put(key, buf)

    def get(self, key: str, buf: torch.Tensor) -> bool:
        blob = self.cache.get(key)
        if blob is None:
            blob = self.data.get(key)
            if blob is None:
                return False
            self.cache[key] = blob
        if len(blob) != buf.numel():
            return False
        copy_into(buf, blob)
        return True


class ExistsByFirstComponent(GoodMemory):
    """EXISTS answers for a page's ``v`` key by looking up its ``k`` key (one lookup per page):
    a page whose ``v`` component is missing is reported present.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "Exactly one bool per key: `EXISTS`
    present and readable".
    """

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        out = []
        for key in keys:
            parts = key.split(".")
            if len(parts) > 2 and parts[2] == "v":
                parts[2] = "k"
            out.append(".".join(parts) in self.data)
        return out


class SetDropsOverflow(GoodMemory):
    """SET stores only the first 256 keys of a batch and reports ``True`` for all of them.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "`SET` durably and atomically
    published" (a ``True`` says the key is stored).
    """

    LIMIT = 256

    def io(self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None) -> list[bool] | None:
        if op is IoOp.SET and len(keys) > self.LIMIT:
            assert buffers is not None
            super().io(op, keys[: self.LIMIT], buffers[: self.LIMIT])
            return [True] * len(keys)
        return super().io(op, keys, buffers)


class TupleResults(GoodMemory):
    """The I/O hooks return tuples instead of lists (``()`` for an empty batch).

    Breaks: CONTRIBUTING.md 1.4, the hookspecs: ``hicache_batch_io_v1(...) -> list[bool]``,
    ``hicache_batch_io_v2(...) -> list[list[bool]]``; "Empty `keys` returns `[]`"; "Empty
    `transfers` returns `[]`".
    """

    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None
    ) -> Any:
        return tuple(super().hicache_batch_io_v1(op, keys, buffers) or ())

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> Any:
        return tuple(super().hicache_batch_io_v2(op, transfers) or ())


class RaisesOnMissing(GoodMemory):
    """GET of a key that is not stored raises ``KeyError`` instead of reporting ``False``.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "Exactly one bool per key" and "Raise
    only for whole-call failures".
    """

    def get(self, key: str, buf: torch.Tensor) -> bool:
        blob = self.data[key]  # KeyError for a key that is not stored
        if len(blob) != buf.numel():
            return False
        copy_into(buf, blob)
        return True


class IgnoresStrides(GoodMemory):
    """SET reads a buffer as ``numel`` contiguous bytes from its first element, ignoring its
    strides: the non-contiguous page views of ``layer_first`` pools are stored with the wrong
    bytes (other pages' layers).

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "one `torch.uint8` CPU view per key
    (non-contiguous for `layer_first` pools)" and "`GET` the buffer now holds the stored bytes".
    """

    def put(self, key: str, buf: torch.Tensor) -> bool:
        self.data[key] = bytes(buf.as_strided((buf.numel(),), (1,)).numpy().tobytes())
        return True


class ClaimsSetSkipsExisting(GoodMemory):
    """Declares ``set_skips_existing=True`` but its SET overwrites a stored key.

    Breaks: CONTRIBUTING.md 1.3: "`set_skips_existing` (default `False`): your `SET` of a key that
    is already stored keeps the stored object, reports `True` and moves no bytes for it".
    """

    capabilities = Capabilities(v1=True, v2=True, set_skips_existing=True, draft_io=DraftIoMode.GENERIC)


class StoresHostView(GoodMemory):
    """SET keeps a reference to the caller's host buffer instead of copying its bytes: the
    "stored" page changes whenever the engine reuses that host page.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "`SET` durably and atomically
    published"; the copying template: "A copying backend needs nothing from the pool".
    """

    def put(self, key: str, buf: torch.Tensor) -> bool:
        self.data[key] = buf
        return True

    def get(self, key: str, buf: torch.Tensor) -> bool:
        stored = self.data.get(key)
        if stored is None or stored.numel() != buf.numel():
            return False
        buf.copy_(stored.reshape(buf.shape))
        return True


class ClearReturnsZero(GoodMemory):
    """``hicache_clear`` removes the namespace but always reports ``0`` objects removed.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_clear``: "Remove every object whose key starts with
    `namespace + "."` and return how many".
    """

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        with LOCK:
            for k in [k for k in self.data if k.startswith(namespace + ".")]:
                del self.data[k]
        return 0
