"""Deliberately broken backends: each has ONE defect that a named conformance test must catch.

``GoodMemory`` is a small correct in-memory backend (v1 + copying v2, every pool, draft
``generic``, ``hicache_clear``); every other class changes one behaviour. The module is
installed as a throwaway distribution (module ``hicache_broken_backends``) by
``test_broken_backends.py``, which asserts that the suite fails each defect by name.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from hicache_core import Capabilities, DraftIo, DraftIoMode, IoOp, PoolName, PoolTransfer, hookimpl
from hicache_core.paging.keys import KeyScheme

STORE: dict[str, bytes] = {}
LOCK = threading.Lock()


class GoodMemory:
    """A correct backend: the reference the defects below are derived from."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    capabilities = Capabilities(v1=True, v2=True, draft_io=DraftIoMode.GENERIC)

    def __init__(self, config: Any, options: Any) -> None:
        self.config = config
        self.data = STORE
        self.pools: dict[PoolName, Any] = {}

    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: Any) -> None:
        self.pools[pool_name] = pool

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        return DraftIo(DraftIoMode.GENERIC, "in-memory copy")

    # one key --------------------------------------------------------------
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.data for k in keys]

    def put(self, key: str, buf: torch.Tensor) -> bool:
        self.data[key] = bytes(buf.contiguous().view(-1).numpy().tobytes())
        return True

    def get(self, key: str, buf: torch.Tensor) -> bool:
        blob = self.data.get(key)
        if blob is None or len(blob) != buf.numel():
            return False
        buf.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(buf.shape))
        return True

    def io(self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None) -> list[bool] | None:
        with LOCK:
            if op is IoOp.EXISTS:
                return self.exists_many(keys)
            assert buffers is not None
            fn = self.put if op is IoOp.SET else self.get
            return [fn(k, b) for k, b in zip(keys, buffers)]

    # hooks ----------------------------------------------------------------
    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None
    ) -> list[bool] | None:
        return self.io(op, keys, buffers)

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]] | None:
        out = []
        for t in transfers:
            if not len(t):
                out.append([])
                continue
            pool = self.pools[t.pool]
            views = pool.page_views(t.host_indices) if op is not IoOp.EXISTS else [None] * len(t)
            flags = []
            for keys, page in zip(t.keys, views):
                res = self.io(op, keys, page)
                flags.append(bool(res) and all(res))
            out.append(flags)
        return out

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        with LOCK:
            gone = [k for k in self.data if k.startswith(namespace + ".")]
            for k in gone:
                del self.data[k]
        return len(gone)


class NoCopyGet(GoodMemory):
    """get returns True without copying any bytes."""

    def get(self, key: str, buf: torch.Tensor) -> bool:
        return key in self.data


class ExistsIgnoresHoles(GoodMemory):
    """exists counts present keys and reports a leading run of that length (holes ignored)."""

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        count = sum(k in self.data for k in keys)
        return [True] * count + [False] * (len(keys) - count)

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]] | None:
        out = super().hicache_batch_io_v2(op, transfers) or []
        if op is IoOp.EXISTS:
            out = [[True] * sum(flags) + [False] * (len(flags) - sum(flags)) for flags in out]
        return out


class ResetAppends(GoodMemory):
    """set of an existing key appends the new bytes (like a file opened in append mode)."""

    def put(self, key: str, buf: torch.Tensor) -> bool:
        new = bytes(buf.contiguous().view(-1).numpy().tobytes())
        self.data[key] = self.data.get(key, b"") + new
        return True


class ResetMixes(GoodMemory):
    """set of an existing key overwrites only its first half (stale bytes stay in the rest)."""

    def put(self, key: str, buf: torch.Tensor) -> bool:
        new = bytes(buf.contiguous().view(-1).numpy().tobytes())
        old = self.data.get(key)
        half = len(new) // 2
        self.data[key] = new if old is None or len(old) != len(new) else new[:half] + old[half:]
        return True


class RankCollide(GoodMemory):
    """Overrides the page keys and forgets the TP rank: ranks read each other's pages."""

    @hookimpl
    def hicache_page_keys(self, pool_name: PoolName, page_hashes: Sequence[str]) -> list[tuple[str, ...]]:
        ns = KeyScheme(self.config).namespace
        comps = self.pools[pool_name].components
        return [tuple(f"{ns}.{pool_name.value}.{c}.{h}" for c in comps) for h in page_hashes]


class ShortResults(GoodMemory):
    """get/exists return results only for the keys found (wrong length on a partial batch)."""

    def io(self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None) -> list[bool] | None:
        flags = super().io(op, keys, buffers)
        return [f for f in flags or [] if f] if op is not IoOp.SET else flags


class NoneOnEmpty(GoodMemory):
    """An empty batch returns None instead of []."""

    def io(self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None) -> list[bool] | None:
        return super().io(op, keys, buffers) if keys else None

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]] | None:
        return super().hicache_batch_io_v2(op, transfers) if transfers else None


class PartialCopyOnSizeMismatch(GoodMemory):
    """get into a buffer of another size copies what fits and reports True."""

    def get(self, key: str, buf: torch.Tensor) -> bool:
        blob = self.data.get(key)
        if blob is None:
            return False
        n = min(len(blob), buf.numel())
        buf.view(-1)[:n].copy_(torch.frombuffer(bytearray(blob[:n]), dtype=torch.uint8))
        return True


class ClaimsPersistent(GoodMemory):
    """Declares persistent=True but keeps pages per store instance (lost on reopen)."""

    capabilities = Capabilities(v1=True, v2=True, persistent=True, draft_io=DraftIoMode.GENERIC)

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.data = {}


class ClaimsShared(GoodMemory):
    """Declares shared=True but keeps pages in process memory."""

    capabilities = Capabilities(v1=True, v2=True, shared=True, draft_io=DraftIoMode.GENERIC)


class DraftHookDisagrees(GoodMemory):
    """Declares draft_io=generic, but the hook answers unsupported."""

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        return DraftIo(DraftIoMode.UNSUPPORTED, "changed my mind")


class ClearsEverything(GoodMemory):
    """hicache_clear removes every namespace, not just its own."""

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        with LOCK:
            n = len(self.data)
            self.data.clear()
        return n


class NeedsVendorSdk(GoodMemory):
    """Installed but unusable here (``availability()`` gives the reason)."""

    @classmethod
    def availability(cls) -> str | None:
        return "needs the vendor SDK (module `nosuchsdk`; install it from the vendor)"


#: Backends installed with the others but not run through the suite.
EXTRA_ENTRY_POINTS = {"unavailable-sdk": "NeedsVendorSdk"}

#: entry-point name -> (class name, tests that must fail, text the failure must contain)
DEFECTS: dict[str, tuple[str, list[str], str]] = {
    "good-memory": ("GoodMemory", [], ""),
    "broken-nocopy": ("NoCopyGet", ["test_bytes_exact_after_get", "test_v1_roundtrip[mha-13]"], "bytes"),
    "broken-holes": (
        "ExistsIgnoresHoles",
        ["test_prefix_hole_ends_prefix", "test_prefix_exists_reports_each_page", "test_v1_exists_per_key"],
        "",
    ),
    "broken-reset-appends": ("ResetAppends", ["test_idempotent_reset_keeps_bytes"], "re-set"),
    "broken-reset-mixes": ("ResetMixes", ["test_idempotent_reset_never_mixes"], "old or the new"),
    "broken-rank-keys": ("RankCollide", ["test_isolation_mha_tp_ranks"], "keys collide"),
    "broken-short-results": (
        "ShortResults",
        ["test_partial_results_per_page", "test_v1_get_missing"],
        "bools",
    ),
    "broken-none-on-empty": (
        "NoneOnEmpty",
        ["test_v1_roundtrip[mha-0]", "test_v2_roundtrip[0]"],
        "must return []",
    ),
    "broken-size-mismatch": ("PartialCopyOnSizeMismatch", ["test_v1_size_mismatch_is_miss"], "sized buffers"),
    "broken-persistent": ("ClaimsPersistent", ["test_persistence_reopen"], "capabilities.persistent"),
    "broken-shared": ("ClaimsShared", ["test_shared_two_processes"], "capabilities.shared"),
    "broken-draft-hook": (
        "DraftHookDisagrees",
        ["test_contract_draft_io_consistent"],
        "capabilities.draft_io",
    ),
    "broken-clear-all": ("ClearsEverything", ["test_clear_removes_only_namespace"], "other namespace"),
}
