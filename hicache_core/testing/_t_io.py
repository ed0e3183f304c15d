"""Groups ``v1``, ``v2``, ``pools`` and ``draft``: moving pages and checking every byte."""

from __future__ import annotations

import warnings

import pytest

from hicache_core import (
    DraftIoMode,
    DraftOffloadDisabledWarning,
    HostPool,
    HostPoolGroup,
    IoOp,
    MHAKVPool,
    PoolName,
    PoolTransfer,
)

from ._base import SuiteBase
from ._context import SENTINEL, SuiteContext, expect_flags
from ._rules import rule

__all__ = ["DraftTests", "PoolsTests", "V1Tests", "V2Tests"]

BATCH_SIZES = (0, 1, 13, 300)
V1_CASES = [(kind, n) for kind in ("mha", "mla") for n in BATCH_SIZES]
KV = PoolName.KV


class V1Tests(SuiteBase):
    """Group ``v1`` (skipped when ``capabilities.v1`` is not declared)."""

    @rule("R9", "R11", "R15", "R17", "R20")
    @pytest.mark.parametrize(("kind", "pages"), V1_CASES, ids=[f"{k}-{n}" for k, n in V1_CASES])
    def test_v1_roundtrip(self, hc: SuiteContext, kind: str, pages: int) -> None:
        """R9, R11, R15, R17, R20: exists (absent) -> set -> exists -> get: one bool per component key, exact bytes."""
        hc.require("v1")
        store, pool = hc.kv_store(kind, max(pages, 1))
        if pages == 0:
            hook = store.pm.hook.hicache_batch_io_v1
            for op in IoOp:
                got = hook(op=op, keys=[], buffers=None if op is IoOp.EXISTS else [], pool_name=PoolName.KV)
                assert got == [], f"hicache_batch_io_v1({op.value!r}, keys=[]) must return [], got {got!r}"
            assert store.batch_io_v1(IoOp.SET, [], []) == []
            return
        ncomp = 2 if kind == "mha" else 1
        assert len(pool.components) == ncomp
        hashes, idx = self.make_page_hashes(pages), list(range(pages))
        nkeys = pages * ncomp
        expect_flags(hc.v1(store, IoOp.EXISTS, KV, pool, hashes, idx), [False] * nkeys, "exists before set")
        hc.fill(pool, idx, hashes)
        expect_flags(hc.v1(store, IoOp.SET, KV, pool, hashes, idx), [True] * nkeys, "set")
        expect_flags(hc.v1(store, IoOp.EXISTS, KV, pool, hashes, idx), [True] * nkeys, "exists after set")
        hc.sentinel(pool, idx)
        expect_flags(hc.v1(store, IoOp.GET, KV, pool, hashes, idx), [True] * nkeys, "get")
        expect_flags(hc.matches(pool, idx, hashes), [True] * pages, "bytes after get")

    @rule("R6", "R11")
    @pytest.mark.parametrize("kind", ["mha", "mla"])
    def test_v1_layer_first(self, hc: SuiteContext, kind: str) -> None:
        """R6, R11: Strided (``layer_first``) page views are read and written in full."""
        hc.require("v1")
        store, pool = hc.kv_store(kind, 13, layout="layer_first")
        hashes, idx = self.make_page_hashes(13), list(range(13))
        assert not pool.page_views([0])[0][0].is_contiguous()
        hc.write(store, KV, pool, hashes, idx, path="v1")
        expect_flags(hc.read(store, KV, pool, hashes, idx, path="v1"), [True] * 13, "get")
        expect_flags(hc.matches(pool, idx, hashes), [True] * 13, "bytes after get")

    @rule("R10")
    def test_v1_get_missing(self, hc: SuiteContext) -> None:
        """R10: ``get`` of keys never set reports ``False`` for each key."""
        hc.require("v1")
        store, pool = hc.kv_store("mha", 5)
        hashes = self.make_page_hashes(5)
        hc.sentinel(pool, range(5))
        expect_flags(
            hc.v1(store, IoOp.GET, KV, pool, hashes, list(range(5))), [False] * 10, "get of absent keys"
        )

    @rule("R13")
    def test_v1_size_mismatch_is_miss(self, hc: SuiteContext) -> None:
        """R13: A stored object whose size differs from the buffer is a miss, never a partial copy."""
        hc.require("v1")
        store, pool = hc.kv_store("mha", 3)
        hashes, idx = self.make_page_hashes(3), [0, 1, 2]
        hc.write(store, KV, pool, hashes, idx, path="v1")
        for head_dim in (self.head_dim * 2, max(1, self.head_dim // 2)):
            other = MHAKVPool(3, self.page_size, self.num_layers, self.num_heads, head_dim, self.kv_dtype)
            store.register_pool(KV, other)
            got = hc.v1(store, IoOp.GET, KV, other, hashes, idx)
            expect_flags(got, [False] * 6, f"get into {head_dim / self.head_dim:g}x-sized buffers")
        store.register_pool(KV, pool)
        expect_flags(hc.read(store, KV, pool, hashes, idx, path="v1"), [True] * 3, "get after the mismatches")
        expect_flags(hc.matches(pool, idx, hashes), [True] * 3, "bytes after the mismatches")

    @rule("R8", "R14")
    def test_v1_exists_per_key(self, hc: SuiteContext) -> None:
        """R8, R14: ``exists`` answers each component key on its own (no page-level shortcut)."""
        hc.require("v1")
        store, pool = hc.kv_store("mha", 6)
        hashes = self.make_page_hashes(6)
        hc.write(store, KV, pool, [hashes[i] for i in (0, 2, 4)], [0, 2, 4], path="v1")
        keys, views = hc.keys_and_views(store, KV, pool, [hashes[5]], [5])
        hc.fill(pool, [5], [hashes[5]])
        assert store.batch_io_v1(IoOp.SET, keys[:1], views[:1], KV) == [True]
        expected = [True, True, False, False, True, True, False, False, True, True, True, False]
        expect_flags(hc.v1(store, IoOp.EXISTS, KV, pool, hashes, list(range(6))), expected, "exists per key")


class V2Tests(SuiteBase):
    """Group ``v2`` (skipped when ``capabilities.v2`` is not declared)."""

    @rule("R10")
    def test_v2_get_missing(self, hc: SuiteContext) -> None:
        """R10: ``get`` of pages never set reports ``False`` for each page (alone and among stored ones)."""
        hc.require("v2")
        store, pool = hc.kv_store("mha", 10)
        hashes = self.make_page_hashes(5)
        expect_flags(
            hc.read(store, KV, pool, hashes, list(range(5)), "v2"), [False] * 5, "get of absent pages"
        )
        hc.write(store, KV, pool, hashes[::2], [0, 2, 4], path="v2")
        got = hc.read(store, KV, pool, hashes, list(range(5, 10)), "v2")
        expect_flags(got, [True, False, True, False, True], "get of absent pages among stored ones")

    @rule("R13")
    def test_v2_size_mismatch_is_miss(self, hc: SuiteContext) -> None:
        """R13: A stored page whose size differs from the registered pool's component is a miss, never a
        partial copy (the pool re-registered under ``kv`` with other page sizes)."""
        hc.require("v2")
        store, pool = hc.kv_store("mha", 3)
        hashes, idx = self.make_page_hashes(3), [0, 1, 2]
        hc.write(store, KV, pool, hashes, idx, path="v2")
        for head_dim in (self.head_dim * 2, max(1, self.head_dim // 2)):
            other = MHAKVPool(3, self.page_size, self.num_layers, self.num_heads, head_dim, self.kv_dtype)
            store.register_pool(KV, other)
            got = hc.read(store, KV, other, hashes, idx, "v2")
            expect_flags(got, [False] * 3, f"v2 get into a pool of {head_dim / self.head_dim:g}x-sized pages")
        store.register_pool(KV, pool)
        expect_flags(hc.read(store, KV, pool, hashes, idx, path="v2"), [True] * 3, "get after the mismatches")
        expect_flags(hc.matches(pool, idx, hashes), [True] * 3, "bytes after the mismatches")

    @rule("R9", "R11", "R15", "R17")
    @pytest.mark.parametrize("pages", BATCH_SIZES)
    def test_v2_roundtrip(self, hc: SuiteContext, pages: int) -> None:
        """R9, R11, R15, R17: KV (MHA) through ``batch_io_v2``: exists -> set -> exists -> get, exact bytes."""
        hc.require("v2")
        store, pool = hc.kv_store("mha", max(pages, 1))
        if pages == 0:
            for op in IoOp:
                got = store.pm.hook.hicache_batch_io_v2(op=op, transfers=[])
                assert got == [], (
                    f"hicache_batch_io_v2({op.value!r}, transfers=[]) must return [], got {got!r}"
                )
                empty = PoolTransfer(KV, (), (), pool.hit_policy, ())
                assert store.batch_io_v2(op, [empty]) == [[]], "a transfer with no pages gets [] in its slot"
            return
        hashes, idx = self.make_page_hashes(pages), list(range(pages))
        spec = [(KV, pool, hashes, idx)]
        expect_flags(hc.v2(store, IoOp.EXISTS, spec)[0], [False] * pages, "exists before set")
        hc.fill(pool, idx, hashes)
        expect_flags(hc.v2(store, IoOp.SET, spec)[0], [True] * pages, "set")
        expect_flags(hc.v2(store, IoOp.EXISTS, spec)[0], [True] * pages, "exists after set")
        hc.sentinel(pool, idx)
        expect_flags(hc.v2(store, IoOp.GET, spec)[0], [True] * pages, "get")
        expect_flags(hc.matches(pool, idx, hashes), [True] * pages, "bytes after get")

    @rule("R6", "R16")
    def test_v2_kv_mamba_trailing(self, hc: SuiteContext) -> None:
        """R6, R16: KV + MAMBA in one call; Mamba state exists only for the trailing pages written."""
        hc.require("v2")
        hc.require_pool(PoolName.MAMBA)
        store = hc.open()
        kv, mamba = self.make_kv_pool("mha", 8), self.make_mamba_pool(4)
        store.register_pool(KV, kv)
        store.register_pool(PoolName.MAMBA, mamba)
        hashes, idx = self.make_page_hashes(8), list(range(8))
        hc.fill(kv, idx, hashes)
        hc.fill(mamba, [0, 1], hashes[6:])
        ok = hc.v2(store, IoOp.SET, [(KV, kv, hashes, idx), (PoolName.MAMBA, mamba, hashes[6:], [0, 1])])
        assert ok == [[True] * 8, [True] * 2], f"set: {ok}"
        found = hc.v2(store, IoOp.EXISTS, [(KV, kv, hashes, idx), (PoolName.MAMBA, mamba, hashes, [0] * 8)])
        expect_flags(found[0], [True] * 8, "kv exists")
        expect_flags(found[1], [False] * 6 + [True] * 2, "mamba exists (state of the last 2 pages only)")
        hc.sentinel(kv, idx)
        hc.sentinel(mamba, [2, 3])
        got = hc.v2(store, IoOp.GET, [(KV, kv, hashes, idx), (PoolName.MAMBA, mamba, hashes[6:], [2, 3])])
        assert got == [[True] * 8, [True] * 2], f"get: {got}"
        expect_flags(hc.matches(kv, idx, hashes), [True] * 8, "kv bytes")
        expect_flags(hc.matches(mamba, [2, 3], hashes[6:]), [True] * 2, "mamba bytes")

    @rule("R6", "R16")
    def test_v2_kv_indexer_all_pages(self, hc: SuiteContext) -> None:
        """R6, R16: KV + INDEXER in one call; per-page facts when the indexer has fewer pages."""
        hc.require("v2")
        hc.require_pool(PoolName.INDEXER)
        store = hc.open()
        kv, ix = self.make_kv_pool("mha", 8), self.make_indexer_pool(8)
        store.register_pool(KV, kv)
        store.register_pool(PoolName.INDEXER, ix)
        hashes, idx = self.make_page_hashes(8), list(range(8))
        hc.fill(kv, idx, hashes)
        hc.fill(ix, idx, hashes)
        ok = hc.v2(store, IoOp.SET, [(KV, kv, hashes, idx), (PoolName.INDEXER, ix, hashes[:5], idx[:5])])
        assert ok == [[True] * 8, [True] * 5], f"set: {ok}"
        found = hc.v2(store, IoOp.EXISTS, [(KV, kv, hashes, idx), (PoolName.INDEXER, ix, hashes, idx)])
        expect_flags(found[0], [True] * 8, "kv exists")
        expect_flags(found[1], [True] * 5 + [False] * 3, "indexer exists")
        hc.sentinel(kv, idx)
        hc.sentinel(ix, idx)
        got = hc.v2(
            store, IoOp.GET, [(KV, kv, hashes[:5], idx[:5]), (PoolName.INDEXER, ix, hashes[:5], idx[:5])]
        )
        assert got == [[True] * 5, [True] * 5], f"get: {got}"
        expect_flags(hc.matches(kv, idx[:5], hashes[:5]), [True] * 5, "kv bytes")
        expect_flags(hc.matches(ix, idx[:5], hashes[:5]), [True] * 5, "indexer bytes")

    @rule("R35")
    def test_v2_draft(self, hc: SuiteContext) -> None:
        """R35: ``draft_io=zero_copy_v2``: draft pages move over v2 with the target pages."""
        hc.require("v2")
        if hc.caps.draft_io is not DraftIoMode.ZERO_COPY_V2:
            pytest.skip(f"backend {hc.name!r} declares draft_io={hc.caps.draft_io.value!r}, not zero_copy_v2")
        n = 6
        kv, draft = self.make_kv_pool("mha", 2 * n), self.make_draft_pool(2 * n)
        ctl = hc.controller(HostPoolGroup(kv, {PoolName.DRAFT: draft}))
        assert ctl.draft_enabled and ctl.draft_io.mode is DraftIoMode.ZERO_COPY_V2, hc.declared(
            "draft_io", f"the controller resolved draft I/O to {ctl.draft_io}"
        )
        hashes, src, dst = self.make_page_hashes(n), list(range(n)), list(range(n, 2 * n))
        hc.fill(kv, src, hashes)
        hc.fill(draft, src, hashes, salt=7)
        res = ctl.backup(hashes, src)
        assert res.pages == n and res.draft == [True] * n, hc.declared("draft_io", f"backup: {res}")
        expect_flags(
            hc.v2(ctl.store, IoOp.EXISTS, [(PoolName.DRAFT, draft, hashes, src)])[0], [True] * n, "draft"
        )
        hc.sentinel(kv, dst)
        hc.sentinel(draft, dst)
        res = ctl.prefetch(hashes, dst)
        assert res.pages == n and res.draft == [True] * n, hc.declared("draft_io", f"prefetch: {res}")
        expect_flags(hc.matches(draft, dst, hashes, salt=7), [True] * n, "draft bytes")
        expect_flags(hc.matches(kv, dst, hashes), [True] * n, "kv bytes")


class PoolsTests(SuiteBase):
    """Group ``pools``: multi-pool pages through ``CacheController`` (whatever path it picks)."""

    @rule("R6")
    def test_pools_kv_mamba(self, hc: SuiteContext, io_path: str) -> None:
        """R6: Backup, query and prefetch KV + Mamba state (trailing-pages hit policy)."""
        hc.require_pool(PoolName.MAMBA)
        n = 8
        kv, mamba = self.make_kv_pool("mha", 2 * n), self.make_mamba_pool(4)
        ctl = hc.controller(HostPoolGroup(kv, {PoolName.MAMBA: mamba}), path=io_path)
        hashes = self.make_page_hashes(n)
        hc.fill(kv, range(n), hashes)
        hc.fill(mamba, [0, 1], hashes[-2:])
        res = ctl.backup(hashes, list(range(n)), extra={PoolName.MAMBA: [0, 1]})
        assert res.ok and res.pages == n, f"backup: {res}"
        assert ctl.query(hashes).pages == n
        assert ctl.query(hashes[:4]).pages == 0, "no Mamba state was stored at page 4: nothing is resumable"
        hc.sentinel(kv, range(n, 2 * n))
        hc.sentinel(mamba, [2, 3])
        res = ctl.prefetch(hashes, list(range(n, 2 * n)), extra={PoolName.MAMBA: [2, 3]})
        assert res.pages == n, f"prefetch: {res}"
        expect_flags(hc.matches(kv, range(n, 2 * n), hashes), [True] * n, "kv bytes")
        expect_flags(hc.matches(mamba, [2, 3], hashes[-2:]), [True] * 2, "mamba bytes")

    @rule("R6")
    def test_pools_kv_indexer(self, hc: SuiteContext, io_path: str) -> None:
        """R6: KV + DSA indexer (all-pages policy): a missing indexer page ends the prefix."""
        hc.require_pool(PoolName.INDEXER)
        n = 8
        kv, ix = self.make_kv_pool("mha", 2 * n), self.make_indexer_pool(2 * n)
        ctl = hc.controller(HostPoolGroup(kv, {PoolName.INDEXER: ix}), path=io_path)
        hashes = self.make_page_hashes(n)
        src, dst = list(range(n)), list(range(n, 2 * n))
        hc.fill(kv, src, hashes)
        hc.fill(ix, src, hashes)
        res = ctl.backup(hashes, src)
        assert res.ok and res.pages == n, f"backup: {res}"
        holed = self.make_page_hashes(n, salt=1)
        hc.write(ctl.store, KV, kv, holed, src, path=ctl.io_path)
        hc.write(ctl.store, PoolName.INDEXER, ix, holed[:5], src[:5], path=ctl.io_path)
        assert ctl.query(hashes).pages == n
        assert ctl.query(holed).pages == 5
        hc.sentinel(kv, dst)
        hc.sentinel(ix, dst)
        res = ctl.prefetch(holed, dst)
        assert res.pages == 5, f"prefetch: {res}"
        expect_flags(hc.matches(kv, dst[:5], holed[:5]), [True] * 5, "kv bytes")
        expect_flags(hc.matches(ix, dst[:5], holed[:5]), [True] * 5, "indexer bytes")

    @rule("R7")
    def test_pools_store_allocated(self, hc: SuiteContext, io_path: str) -> None:
        """R7: Planned pools (``allocate=False``) get memory through the store and round-trip."""
        n = 6
        extras: dict[PoolName | str, HostPool] = {}
        if PoolName.INDEXER in hc.caps.pools:
            extras[PoolName.INDEXER] = self.make_indexer_pool(2 * n, allocate=False)
        kv = self.make_kv_pool("mha", 2 * n, allocate=False)
        ctl = hc.controller(HostPoolGroup(kv, extras), path=io_path)
        assert kv.allocated and all(p.allocated for p in extras.values())
        hashes = self.make_page_hashes(n)
        for pool in ctl.pools.values():
            hc.fill(pool, range(n), hashes)
        assert ctl.backup(hashes, list(range(n))).pages == n
        for pool in ctl.pools.values():
            hc.sentinel(pool, range(n, 2 * n))
        assert ctl.prefetch(hashes, list(range(n, 2 * n))).pages == n
        for name, pool in ctl.pools.items():
            expect_flags(hc.matches(pool, range(n, 2 * n), hashes), [True] * n, f"{name.value} bytes")

    @rule("R5")
    def test_pools_reregister_replaces(self, hc: SuiteContext, io_path: str) -> None:
        """R5: Registering pool B under a name that pool A had replaces A: I/O moves B's pages, and A
        (released) is never read or written again."""
        store = hc.open()
        first, second = self.make_kv_pool("mha", 4), self.make_kv_pool("mha", 4)
        store.register_pool(KV, first)
        hc.sentinel(first, range(4))
        store.register_pool(KV, second)
        hashes = self.make_page_hashes(2)
        hc.write(store, KV, second, hashes, [0, 1], path=io_path)
        expect_flags(hc.read(store, KV, second, hashes, [2, 3], io_path), [True, True], "get into pool B")
        expect_flags(
            hc.matches(second, [2, 3], hashes), [True, True], "pool B holds the bytes set from pool B"
        )
        untouched = all(bool((b == SENTINEL).all()) for b in first.buffers())
        assert untouched, f"{io_path} I/O after re-registering 'kv' still used the first pool object"
        again = self.make_kv_pool("mha", 4)
        store.register_pool(KV, again)
        expect_flags(hc.read(store, KV, again, hashes, [1, 3], io_path), [True, True], "get into pool C")
        expect_flags(hc.matches(again, [1, 3], hashes), [True, True], "pool C bytes")


class DraftTests(SuiteBase):
    """Group ``draft`` (skipped when ``draft_io`` is ``unsupported``)."""

    @rule("R35")
    def test_draft_roundtrip(self, hc: SuiteContext, io_path: str) -> None:
        """R35: Draft pages are backed up and prefetched with their target pages (moved on ``io_path``),
        byte-exact; the draft pool's own pages also round-trip through ``io_path``."""
        if hc.caps.draft_io is DraftIoMode.UNSUPPORTED:
            pytest.skip(f"backend {hc.name!r} declares draft_io='unsupported'")
        n = 7
        kv, draft = self.make_kv_pool("mha", 2 * n), self.make_draft_pool(2 * n)
        with warnings.catch_warnings():
            if hc.caps.draft_io is DraftIoMode.ZERO_COPY_V2 and io_path == "v1":  # disabled, as designed
                warnings.simplefilter("ignore", DraftOffloadDisabledWarning)
            ctl = hc.controller(HostPoolGroup(kv, {PoolName.DRAFT: draft}), path=io_path)
        hashes, src, dst = self.make_page_hashes(n), list(range(n)), list(range(n, 2 * n))
        raw = self.make_page_hashes(n, salt=31)
        if PoolName.DRAFT not in ctl.store.pools:  # zero_copy_v2 draft is off on the v1 path
            assert hc.caps.draft_io is DraftIoMode.ZERO_COPY_V2 and io_path == "v1", hc.declared(
                "draft_io", f"the controller disabled draft offload: {ctl.draft_io}"
            )
            ctl.store.register_pool(PoolName.DRAFT, draft)
            hc.write(ctl.store, PoolName.DRAFT, draft, raw, src, salt=4, path=io_path)
            expect_flags(
                hc.read(ctl.store, PoolName.DRAFT, draft, raw, dst, io_path), [True] * n, "draft get"
            )
            expect_flags(hc.matches(draft, dst, raw, salt=4), [True] * n, "draft bytes (raw)")
            return
        assert ctl.draft_enabled, hc.declared(
            "draft_io", f"the controller disabled draft offload: {ctl.draft_io}"
        )
        hc.write(ctl.store, PoolName.DRAFT, draft, raw, src, salt=4, path=io_path)
        expect_flags(hc.read(ctl.store, PoolName.DRAFT, draft, raw, dst, io_path), [True] * n, "draft get")
        expect_flags(hc.matches(draft, dst, raw, salt=4), [True] * n, "draft bytes (raw)")
        hc.fill(kv, src, hashes)
        hc.fill(draft, src, hashes, salt=3)
        res = ctl.backup(hashes, src)
        assert res.pages == n and res.draft == [True] * n, hc.declared("draft_io", f"backup: {res}")
        hc.sentinel(kv, dst)
        hc.sentinel(draft, dst)
        res = ctl.prefetch(hashes, dst)
        assert res.pages == n and res.draft == [True] * n, hc.declared("draft_io", f"prefetch: {res}")
        expect_flags(hc.matches(draft, dst, hashes, salt=3), [True] * n, "draft bytes")
        expect_flags(hc.matches(kv, dst, hashes), [True] * n, "kv bytes")
