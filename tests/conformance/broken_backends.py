"""Example backends for the conformance suite: correct references and deliberately broken ones.

``GoodMemory`` is a small correct in-memory backend (v1 + copying v2, every pool, draft
``generic``, ``hicache_clear``); every ``broken-*`` example changes ONE behaviour that the
contract (CONTRIBUTING.md section 1, design.md sections 3, 4 and 8) forbids, and its docstring
names the defect and quotes the rule it breaks (``Breaks: ...``). The examples live in this
module and in ``broken_backends_*.py`` (v2 path, key schemes, file-writing backends, v1 and
result shapes, and ``broken_backends_rules.py``: defects written from the numbered rules before
the rule tests existed); :data:`EXAMPLES` lists every one with the suite tests that must catch it.

``test_broken_backends.py`` installs these modules as a throwaway distribution (package
``hicache_broken_backends``, one ``hicache.backends`` entry point per example) and runs
``hicache check`` on each: the correct examples must pass, every broken one must fail, named by
its tests. ``run_broken_three_times.py`` does the same three times over.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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

STORE: dict[str, Any] = {}
LOCK = threading.RLock()


def as_bytes(buf: torch.Tensor) -> bytes:
    """The bytes of a (possibly strided) uint8 view, in logical order."""
    return bytes(buf.contiguous().view(-1).numpy().tobytes())


def copy_into(buf: torch.Tensor, blob: bytes) -> None:
    """Copy ``blob`` (exactly ``buf.numel()`` bytes) into ``buf``."""
    buf.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(buf.shape))


def copy_what_fits(buf: torch.Tensor, blob: bytes) -> None:
    """Copy the first ``min(len(blob), buf.numel())`` bytes of ``blob`` into ``buf`` (strided or not)."""
    flat = buf.reshape(-1).clone()
    n = min(len(blob), flat.numel())
    flat[:n] = torch.frombuffer(bytearray(blob[:n]), dtype=torch.uint8)
    buf.copy_(flat.view(buf.shape))


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
        self.data[key] = as_bytes(buf)
        return True

    def get(self, key: str, buf: torch.Tensor) -> bool:
        blob = self.data.get(key)
        if blob is None or len(blob) != buf.numel():
            return False
        copy_into(buf, blob)
        return True

    def io(self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None) -> list[bool] | None:
        with LOCK:
            if op is IoOp.EXISTS:
                return self.exists_many(keys)
            assert buffers is not None
            fn = self.put if op is IoOp.SET else self.get
            return [fn(k, b) for k, b in zip(keys, buffers)]

    # one v2 page ----------------------------------------------------------
    def page_io(self, op: IoOp, keys: Sequence[str], views: Sequence[torch.Tensor] | None) -> bool:
        """One page of a v2 transfer: ``True`` only when every component succeeded."""
        res = self.io(op, keys, views)
        return bool(res) and all(res)

    def transfer_io(self, op: IoOp, t: PoolTransfer) -> list[bool]:
        """One v2 transfer: one bool per page."""
        check_keys([key for keys in t.keys for key in keys])
        pool = self.pools[t.pool]
        views = pool.page_views(t.host_indices) if op is not IoOp.EXISTS else [None] * len(t)
        return [self.page_io(op, keys, page) for keys, page in zip(t.keys, views)]

    # hooks ----------------------------------------------------------------
    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None
    ) -> list[bool] | None:
        check_keys(keys)  # keys are trusted nowhere: refuse '..', separators (KeyFormatError)
        return self.io(op, keys, buffers)

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]] | None:
        return [self.transfer_io(op, t) if len(t) else [] for t in transfers]

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        with LOCK:
            gone = [k for k in self.data if k.startswith(namespace + ".")]
            for k in gone:
                del self.data[k]
        return len(gone)


class NoCopyGet(GoodMemory):
    """GET reports ``True`` without copying any bytes.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "`GET` the buffer now holds the stored
    bytes".
    """

    def get(self, key: str, buf: torch.Tensor) -> bool:
        return key in self.data


class ExistsIgnoresHoles(GoodMemory):
    """EXISTS counts the present keys and reports a leading run of that length (holes ignored).

    Breaks: CONTRIBUTING.md 1.4: "Exactly one bool per key: `EXISTS` present and readable" and
    "Report raw per-page facts (the controller applies hit policies)".
    """

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
    """SET of an existing key appends the new bytes (like a file opened in append mode).

    Breaks: design.md 8, the suite covers "idempotent re-set"; CONTRIBUTING.md 1.4: "`SET`
    durably and atomically published (an existing key may be skipped and reported `True`)".
    """

    def put(self, key: str, buf: torch.Tensor) -> bool:
        self.data[key] = self.data.get(key, b"") + as_bytes(buf)
        return True


class ResetMixes(GoodMemory):
    """SET of an existing key overwrites only its first half (stale bytes stay in the rest).

    Breaks: CONTRIBUTING.md 1.4: "`SET` durably and atomically published"; the template: "atomic:
    readers see the old state or the whole page".
    """

    def put(self, key: str, buf: torch.Tensor) -> bool:
        new = as_bytes(buf)
        old = self.data.get(key)
        half = len(new) // 2
        self.data[key] = new if old is None or len(old) != len(new) else new[:half] + old[half:]
        return True


class ShortResults(GoodMemory):
    """GET/EXISTS return results only for the keys found (wrong length on a partial batch).

    Breaks: CONTRIBUTING.md 1.4: "Exactly one bool per key" and "A hook never returns `None`
    silently: the store turns `None`, a wrong length or non-bool entries into
    `BackendContractError`".
    """

    def io(self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None) -> list[bool] | None:
        flags = super().io(op, keys, buffers)
        return [f for f in flags or [] if f] if op is not IoOp.SET else flags


class NoneOnEmpty(GoodMemory):
    """An empty batch returns ``None`` instead of ``[]``.

    Breaks: CONTRIBUTING.md 1.4: "Empty `keys` returns `[]` without touching storage" and
    "Empty `transfers` returns `[]`".
    """

    def io(self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None) -> list[bool] | None:
        return super().io(op, keys, buffers) if keys else None

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]] | None:
        return super().hicache_batch_io_v2(op, transfers) if transfers else None


class PartialCopyOnSizeMismatch(GoodMemory):
    """GET into a buffer of another size copies what fits and reports ``True``.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "a stored object of another size is
    `False`"; the template: "a size mismatch is a miss, never a partial copy".
    """

    def get(self, key: str, buf: torch.Tensor) -> bool:
        blob = self.data.get(key)
        if blob is None:
            return False
        copy_what_fits(buf, blob)
        return True


class ClaimsPersistent(GoodMemory):
    """Declares ``persistent=True`` but keeps pages per store instance (lost on reopen).

    Breaks: CONTRIBUTING.md 1.3: "`persistent`: pages survive closing and reopening the store on
    the same options".
    """

    capabilities = Capabilities(v1=True, v2=True, persistent=True, draft_io=DraftIoMode.GENERIC)

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.data = {}


class ClaimsShared(GoodMemory):
    """Declares ``shared=True`` but keeps pages in process memory.

    Breaks: CONTRIBUTING.md 1.3: "`shared`: pages written by one process are visible to other
    processes using the same options".
    """

    capabilities = Capabilities(v1=True, v2=True, shared=True, draft_io=DraftIoMode.GENERIC)


class DraftHookDisagrees(GoodMemory):
    """Declares ``draft_io=generic``, but the hook answers ``unsupported``.

    Breaks: CONTRIBUTING.md 1.3: "`hicache_draft_io_capability` must agree with it" and 1.4:
    "Under a default config it must equal `capabilities.draft_io`".
    """

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        return DraftIo(DraftIoMode.UNSUPPORTED, "changed my mind")


class ClearsEverything(GoodMemory):
    """``hicache_clear`` removes every namespace, not just its own.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_clear``: "Remove every object whose key starts with
    `namespace + "."` and return how many; other namespaces are untouched".
    """

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


# ------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Example:
    """One example backend, run through ``hicache check`` by ``test_broken_backends.py``.

    ``target`` is ``module:Class`` with ``module`` one of the ``broken_backends*`` modules.
    ``caught_by`` lists the suite tests that must fail (empty for a correct example, which must
    pass the whole suite), each failure mentioning ``says``, each named by ``hicache check``.
    ``pending`` says why the current suite cannot catch the defect by those names yet: the check
    of that example is then a strict xfail (so the entry must be updated as soon as it is caught).
    """

    name: str
    target: str
    caught_by: tuple[str, ...] = ()
    says: str = ""
    pending: str | None = None

    @property
    def broken(self) -> bool:
        return bool(self.caught_by)

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def cls(self) -> str:
        return self.target.partition(":")[2]


def _ex(
    name: str,
    target: str,
    *caught_by: str,
    says: str = "",
    pending: str | None = None,
) -> Example:
    module, _, cls = target.rpartition(":")
    return Example(name, f"{module or 'broken_backends'}:{cls}", caught_by, says, pending)


_V2 = "broken_backends_v2:"
_KEYS = "broken_backends_keys:"
_FILE = "broken_backends_file:"
_IO = "broken_backends_io:"
_RULES = "broken_backends_rules:"
_GUARD = "broken_backends_guard:"

#: Every example, correct ones first. ``caught_by`` names the suite tests that must fail: for a
#: defect on one path of a v1 + v2 backend, the test of that path (``[v1]`` / ``[v2]``).
EXAMPLES: tuple[Example, ...] = (
    # correct references: each must pass the whole suite
    _ex("good-memory", "GoodMemory"),
    _ex("good-custom-keys", _KEYS + "GoodCustomKeys"),
    _ex("good-file", _FILE + "GoodFile"),
    # defects the suite caught before this list grew
    _ex(
        "broken-nocopy",
        "NoCopyGet",
        "test_bytes_exact_after_get[v1]",
        "test_v1_roundtrip[mha-13]",
        says="bytes",
    ),
    _ex(
        "broken-holes",
        "ExistsIgnoresHoles",
        "test_prefix_hole_ends_prefix[v2]",
        "test_prefix_exists_reports_each_page[v1]",
        "test_prefix_exists_reports_each_page[v2]",
        "test_v1_exists_per_key",
    ),
    _ex("broken-reset-appends", "ResetAppends", "test_idempotent_reset_keeps_bytes[v1]", says="re-set"),
    _ex("broken-reset-mixes", "ResetMixes", "test_idempotent_reset_never_mixes[v1]", says="old or the new"),
    _ex("broken-rank-keys", _KEYS + "RankCollide", "test_isolation_mha_tp_ranks", says="keys collide"),
    _ex(
        "broken-short-results",
        "ShortResults",
        "test_partial_results_per_page[v1]",
        "test_v1_get_missing",
        says="bools",
    ),
    _ex(
        "broken-none-on-empty",
        "NoneOnEmpty",
        "test_v1_roundtrip[mha-0]",
        "test_v2_roundtrip[0]",
        says="must return []",
    ),
    _ex(
        "broken-size-mismatch",
        "PartialCopyOnSizeMismatch",
        "test_v1_size_mismatch_is_miss",
        says="sized buffers",
    ),
    _ex(
        "broken-persistent", "ClaimsPersistent", "test_persistence_reopen[v1]", says="capabilities.persistent"
    ),
    _ex("broken-shared", "ClaimsShared", "test_shared_two_processes", says="capabilities.shared"),
    _ex(
        "broken-draft-hook",
        "DraftHookDisagrees",
        "test_contract_draft_io_consistent",
        says="capabilities.draft_io",
    ),
    _ex(
        "broken-clear-all",
        "ClearsEverything",
        "test_clear_removes_only_namespace[v1]",
        says="other namespace",
    ),
    # the defects of the issue "the conformance suite catches every mistake a backend author makes"
    _ex("broken-v2-stale-cache", _V2 + "V2StaleReadCache", "test_clear_removes_only_namespace[v2]"),
    _ex(
        "broken-v2-reset-mixes",
        _V2 + "V2ResetMixes",
        "test_idempotent_reset_never_mixes[v2]",
        says="old or the new",
    ),
    _ex("broken-v2-size-mismatch", _V2 + "V2PartialCopyOnSizeMismatch", "test_v2_size_mismatch_is_miss"),
    _ex("broken-v2-zeroes-neighbours", _V2 + "V2ZeroesSpan", "test_bytes_exact_after_get[v2]"),
    _ex("broken-v2-partial-components", _V2 + "V2AnyComponent", "test_partial_missing_component[v2]"),
    _ex("broken-v2-first-pool-kept", _V2 + "KeepsFirstPool", "test_pools_reregister_replaces[v2]"),
    _ex(
        "broken-clear-keeps-cache",
        _IO + "ReadCacheSurvivesClear",
        "test_clear_removes_only_namespace[v1]",
        "test_clear_removes_only_namespace[v2]",
    ),
    _ex(
        "broken-file-unchecked-keys", _FILE + "FileNoKeyCheck", "test_errors_hostile_keys[v1]", says="outside"
    ),
    _ex("broken-keys-model-slug", _KEYS + "SlugKeys", "test_isolation_custom_keys[model_name]"),
    _ex("broken-keys-no-tp-size", _KEYS + "TpRankOnlyKeys", "test_isolation_custom_keys[tp_size]"),
    _ex("broken-file-in-place", _FILE + "FileInPlaceWrite", "test_concurrency_raw_threads[v1]"),
    _ex(
        "broken-file-overwrite-in-place", _FILE + "FileOverwriteInPlace", "test_concurrency_no_torn_pages[v1]"
    ),
    # more mistakes the contract forbids
    _ex(
        "broken-v2-applies-hit-policy",
        _V2 + "AppliesTrailingPolicy",
        "test_v2_kv_mamba_trailing",
        says="mamba exists",
    ),
    _ex(
        "broken-v2-drops-empty-transfer", _V2 + "DropsEmptyTransfers", "test_v2_roundtrip[0]", says="one list"
    ),
    _ex(
        "broken-exists-first-component",
        _IO + "ExistsByFirstComponent",
        "test_v1_exists_per_key",
        "test_partial_missing_component[v1]",
    ),
    _ex(
        "broken-set-drops-overflow",
        _IO + "SetDropsOverflow",
        "test_v1_roundtrip[mha-300]",
        says="exists after set",
    ),
    _ex("broken-tuple-results", _IO + "TupleResults", "test_v1_roundtrip[mha-0]", says="must return []"),
    _ex(
        "broken-get-missing-raises",
        _IO + "RaisesOnMissing",
        "test_v1_get_missing",
        "test_v2_get_missing",
        says="KeyError",
    ),
    _ex("broken-ignores-strides", _IO + "IgnoresStrides", "test_v1_layer_first[mha]", says="bytes after get"),
    _ex(
        "broken-claims-set-skips",
        _IO + "ClaimsSetSkipsExisting",
        "test_idempotent_set_keeps_stored_object[v1]",
        says="capabilities.set_skips_existing",
    ),
    _ex("broken-stores-view", _IO + "StoresHostView", "test_v1_roundtrip[mha-13]", says="bytes after get"),
    _ex(
        "broken-clear-count",
        _IO + "ClearReturnsZero",
        "test_clear_removes_only_namespace[v1]",
        says="clear()",
    ),
    _ex("broken-keys-unsafe", _KEYS + "SlashKeys", "test_contract_page_keys_safe", says="unsafe storage key"),
    _ex(
        "broken-keys-no-pool-error",
        _KEYS + "KeysForAnyPool",
        "test_errors_unregistered_pool",
        says="PoolError",
    ),
    _ex(
        "broken-keys-no-hash-check",
        _KEYS + "KeysWithoutHashCheck",
        "test_errors_bad_page_hash",
        says="KeyFormatError",
    ),
    # rules: written from CONTRIBUTING.md's numbered rules before the rule tests; each passed the
    # whole suite of that day (broken_backends_rules.py)
    _ex("broken-rules-negative-exists", _RULES + "NegativeExistsCache", "test_shared_two_stores[v1]"),
    _ex(
        "broken-rules-clear-own-writes",
        _RULES + "ClearOwnWritesOnly",
        "test_clear_every_pool_every_store[v1]",
    ),
    _ex(
        "broken-rules-cache-foreign-clear",
        _RULES + "CacheSurvivesForeignClear",
        "test_clear_every_pool_every_store[v1]",
    ),
    _ex("broken-rules-index-lost-update", _RULES + "IndexLostUpdate", "test_shared_concurrent_ranks"),
    _ex("broken-rules-write-back", _RULES + "WriteBackUntilClose", "test_persistence_process_exit"),
    _ex("broken-rules-sidecar-in-memory", _RULES + "SidecarPoolsInMemory", "test_persistence_every_pool[v1]"),
    _ex("broken-rules-clear-kv-only", _RULES + "ClearKvOnly", "test_clear_every_pool_every_store[v1]"),
    _ex(
        "broken-rules-sidecar-strides",
        _RULES + "SidecarIgnoresStrides",
        "test_pools_every_kind_every_layout[v1]",
        "test_pools_every_kind_every_layout[v2]",
    ),
    _ex("broken-rules-dedupes-keys", _RULES + "DedupesRepeatedKeys", "test_batch_order_and_repetition[v1]"),
    _ex("broken-rules-v2-sorts-slots", _RULES + "V2SortsHostIndices", "test_batch_order_and_repetition[v2]"),
    _ex("broken-rules-v2-by-pool", _RULES + "V2ResultsByPool", "test_batch_transfers_any_order"),
    _ex("broken-rules-v2-pool-order", _RULES + "V2ResultsInPoolOrder", "test_batch_transfers_any_order"),
    # defects only the guard tests catch (broken_backends_guard.py)
    _ex("broken-guard-v2-reverses", _GUARD + "V2ReversesComponents", "test_pools_cross_path", says="R11"),
    _ex(
        "broken-guard-set-zeroes",
        _GUARD + "SetZeroesSource",
        "test_bytes_set_leaves_host_memory[v1]",
        says="R38",
    ),
    _ex(
        "broken-guard-late-get", _GUARD + "GetWritesLater", "test_bytes_nothing_after_return[v1]", says="R20"
    ),
    _ex("broken-guard-zero-marker", _GUARD + "ZeroPageMarker", "test_bytes_zero_pages[v1]", says="R15"),
    _ex("broken-guard-thread-leak", _GUARD + "ThreadPerStore", "test_discovery_close_releases", says="R2"),
    _ex(
        "broken-guard-skips-written",
        _GUARD + "FileSkipsWhatItWrote",
        "test_clear_then_set_again[v1]",
        says="R17",
    ),
    _ex(
        "broken-guard-symlinks", _GUARD + "FileFollowsSymlinks", "test_errors_symlinked_files[v1]", says="R25"
    ),
    _ex("broken-guard-model-dir", _GUARD + "FileRootPerModel", "test_errors_hostile_model_name", says="R25"),
)

#: Backends installed with the examples but not run through the suite (name -> ``module:Class``).
EXTRA_ENTRY_POINTS = {"unavailable-sdk": "broken_backends:NeedsVendorSdk"}

#: The modules of the examples (installed together as package ``hicache_broken_backends``).
MODULES = (
    "broken_backends",
    "broken_backends_v2",
    "broken_backends_keys",
    "broken_backends_file",
    "broken_backends_io",
    "broken_backends_rules",
    "broken_backends_guard",
)
