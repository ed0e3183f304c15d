"""Groups ``prefix``, ``idempotent``, ``partial``, ``isolation``, ``bytes`` and ``clear``.

Every test taking ``io_path`` runs once per declared raw I/O path (``[v1]``, ``[v2]``): raw calls go
through that path, and controllers are made to move target pages on it (``hc.controller(path=)``).
"""

from __future__ import annotations

from typing import Any

import pytest

from hicache_core import DraftIoMode, HostPool, HostPoolGroup, IoOp, PoolName, PoolTransfer, Store

from ._base import SuiteBase
from ._context import SENTINEL, SuiteContext, expect_flags
from ._rules import rule

__all__ = ["SemanticsTests"]

KV = PoolName.KV
ISOLATION_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "model_name": ({}, {"model_name": "@other-model"}),
    "kv_dtype": ({"kv_dtype": "bfloat16"}, {"kv_dtype": "float8_e4m3fn"}),
    "layout": ({"layout": "page_first"}, {"layout": "layer_first"}),
    "pp_rank": ({"pp_size": 2, "pp_rank": 0}, {"pp_size": 2, "pp_rank": 1}),
    "attn_cp_rank": ({"attn_cp_size": 2, "attn_cp_rank": 0}, {"attn_cp_size": 2, "attn_cp_rank": 1}),
    "model_revision": ({"model_revision": "rev-a"}, {"model_revision": "rev-b"}),
    "tp_size": ({"tp_size": 2, "tp_rank": 0}, {"tp_size": 4, "tp_rank": 0}),
    "pp_size": ({"pp_size": 2, "pp_rank": 0}, {"pp_size": 4, "pp_rank": 0}),
    "attn_cp_size": ({"attn_cp_size": 2, "attn_cp_rank": 0}, {"attn_cp_size": 4, "attn_cp_rank": 0}),
}


class SemanticsTests(SuiteBase):
    """Prefix, idempotence, partial results, key isolation, exact bytes and clear."""

    # ----------------------------------------------------------------- prefix
    def _holed(self, hc: SuiteContext, path: str, n: int = 10, hole: int = 4) -> tuple[Any, Any, list[str]]:
        kv = self.make_kv_pool("mha", 2 * n)
        ctl = hc.controller(kv, path=path)
        hashes = self.make_page_hashes(n)
        hc.fill(kv, range(n), hashes)
        keep = [i for i in range(n) if i != hole]
        res = ctl.backup([hashes[i] for i in keep], keep)
        assert res.ok, f"backup: {res}"
        return ctl, kv, hashes

    @rule("R16")
    def test_prefix_hole_ends_prefix(self, hc: SuiteContext, io_path: str) -> None:
        """R16: With page 4 of 10 missing, query and prefetch report a 4-page prefix."""
        ctl, kv, hashes = self._holed(hc, io_path)
        assert ctl.query(hashes).pages == 4, "a missing page must end the restorable prefix"
        dst = list(range(10, 20))
        hc.sentinel(kv, dst)
        res = ctl.prefetch(hashes, dst)
        assert res.pages == 4, f"prefetch: {res}"
        expect_flags(hc.matches(kv, dst[:4], hashes[:4]), [True] * 4, "prefix bytes")
        assert ctl.query(hashes[5:]).pages == 5

    @rule("R15", "R16")
    def test_prefix_exists_reports_each_page(self, hc: SuiteContext, io_path: str) -> None:
        """R15, R16: Raw ``exists`` and ``get`` report every page's own fact (the hole only), never a count."""
        ctl, kv, hashes = self._holed(hc, io_path)
        expected = [True] * 4 + [False] + [True] * 5
        flags = hc.raw(ctl.store, IoOp.EXISTS, KV, kv, hashes, list(range(10)), path=io_path)
        expect_flags(flags, expected, "exists with a hole at page 4")
        dst = list(range(10, 20))
        expect_flags(hc.read(ctl.store, KV, kv, hashes, dst, io_path), expected, "get with a hole at page 4")
        kept = [d for d, e in zip(dst, expected) if e]
        expect_flags(hc.matches(kv, kept, [h for h, e in zip(hashes, expected) if e]), [True] * 9, "bytes")

    @rule("R16")
    def test_prefix_first_page_missing(self, hc: SuiteContext, io_path: str) -> None:
        """R16: Nothing is restorable when the first page is missing."""
        ctl, _, hashes = self._holed(hc, io_path, hole=0)
        assert ctl.query(hashes).pages == 0
        assert ctl.prefetch(hashes, list(range(10, 20))).pages == 0

    # ------------------------------------------------------------- idempotent
    @rule("R19")
    def test_idempotent_reset_keeps_bytes(self, hc: SuiteContext, io_path: str) -> None:
        """R19: Setting the same pages again succeeds and leaves their bytes unchanged."""
        store, pool = hc.kv_store("mha", 13)
        hashes, idx = self.make_page_hashes(13), list(range(13))
        hc.write(store, KV, pool, hashes, idx, path=io_path)
        hc.write(store, KV, pool, hashes, idx, path=io_path)
        hc.write(store, KV, pool, hashes[:5], idx[:5], path=io_path)
        expect_flags(hc.read(store, KV, pool, hashes, idx, io_path), [True] * 13, "get after re-set")
        expect_flags(hc.matches(pool, idx, hashes), [True] * 13, "bytes after re-set")

    @rule("R19")
    def test_idempotent_reset_never_mixes(self, hc: SuiteContext, io_path: str) -> None:
        """R19: Re-setting a key with other bytes leaves either the old or the new object, whole."""
        store, pool = hc.kv_store("mha", 6)
        hashes, idx = self.make_page_hashes(6), list(range(6))
        hc.write(store, KV, pool, hashes, idx, salt=1, path=io_path)
        hc.write(store, KV, pool, hashes, idx, salt=2, path=io_path)
        expect_flags(hc.read(store, KV, pool, hashes, idx, io_path), [True] * 6, "get after re-set")
        old = hc.component_matches(pool, idx, hashes, salt=1)
        new = hc.component_matches(pool, idx, hashes, salt=2)
        whole = [o or n for po, pn in zip(old, new) for o, n in zip(po, pn)]
        expect_flags(whole, [True] * len(whole), "each component holds the old or the new bytes")

    @rule("R32")
    def test_idempotent_set_keeps_stored_object(self, hc: SuiteContext, io_path: str) -> None:
        """R32: ``set_skips_existing``: SET of stored keys reports ``True`` and keeps the stored bytes;
        the controller's backup (which then has no existence pass) keeps them too."""
        hc.require("set_skips_existing")
        path = io_path
        store, pool = hc.kv_store("mha", 6)
        hashes, idx = self.make_page_hashes(6, salt=50), list(range(6))
        hc.write(store, KV, pool, hashes[:3], idx[:3], salt=1, path=path)
        hc.write(store, KV, pool, hashes, idx, salt=2, path=path)  # every page must report True
        expect_flags(hc.read(store, KV, pool, hashes, idx, path), [True] * 6, f"{path} get after re-set")
        kept = [all(c) for c in hc.component_matches(pool, idx[:3], hashes[:3], salt=1)]
        assert kept == [True] * 3, hc.declared(
            "set_skips_existing", f"{path}: stored pages were overwritten by a second set ({kept})"
        )
        new = [all(c) for c in hc.component_matches(pool, idx[3:], hashes[3:], salt=2)]
        expect_flags(new, [True] * 3, f"{path} bytes of the pages written by the second set")
        ctl = hc.controller(self.make_kv_pool("mha", 4), path=path)
        hashes = self.make_page_hashes(4, salt=60)
        hc.fill(ctl.pools.anchor, range(2), hashes[:2], salt=1)
        assert ctl.backup(hashes[:2], range(2)).pages == 2, "backup of two new pages"
        hc.fill(ctl.pools.anchor, range(4), hashes, salt=2)
        res = ctl.backup(hashes, range(4))
        assert res.pages == 4 and res.ok, f"backup over two stored pages: {res}"
        assert ctl.prefetch(hashes, range(4)).pages == 4
        kept = [all(c) for c in hc.component_matches(ctl.pools.anchor, range(2), hashes[:2], salt=1)]
        assert kept == [True, True], hc.declared(
            "set_skips_existing", f"backup overwrote stored pages ({kept})"
        )

    # ---------------------------------------------------------------- partial
    @rule("R8", "R10")
    def test_partial_results_per_page(self, hc: SuiteContext, io_path: str) -> None:
        """R8, R10: A batch mixing present and absent pages gets exact per-entry results and bytes."""
        path = io_path
        store, pool = hc.kv_store("mha", 8)
        hashes, idx = self.make_page_hashes(8), list(range(8))
        present = [0, 1, 3, 6]
        hc.write(store, KV, pool, [hashes[i] for i in present], present, path=path)
        expected = [i in present for i in idx]
        expect_flags(hc.raw(store, IoOp.EXISTS, KV, pool, hashes, idx, path), expected, f"{path} exists")
        expect_flags(hc.read(store, KV, pool, hashes, idx, path), expected, f"{path} get")
        got = hc.matches(pool, present, [hashes[i] for i in present])
        expect_flags(got, [True] * len(present), f"{path} bytes of the present pages")
        if path == "v1":
            flat = hc.v1(store, IoOp.GET, KV, pool, hashes, idx)
            expect_flags(flat, [e for e in expected for _ in (0, 1)], "v1 get per component key")

    @rule("R14")
    def test_partial_missing_component(self, hc: SuiteContext, io_path: str) -> None:
        """R14: A page with exactly one component missing from storage is never reported: v2 gives the
        page ``False`` (exists and get), v1 the missing key; the other pages are exact."""
        store, pool = hc.kv_store("mha", 12)
        hashes, idx, hole = self.make_page_hashes(6), list(range(6)), 3
        full = [i for i in idx if i != hole]
        hc.write(store, KV, pool, [hashes[i] for i in full], full, path=hc.path)
        self._write_first_component(hc, store, pool, hashes[hole], hole)
        expected = [i != hole for i in idx]
        for _ in range(2):  # the same answer every time
            expect_flags(hc.raw(store, IoOp.EXISTS, KV, pool, hashes, idx, io_path), expected, "exists")
            dst = [6 + i for i in idx]
            expect_flags(
                hc.read(store, KV, pool, hashes, dst, io_path), expected, "get (one component missing)"
            )
            expect_flags(
                hc.matches(pool, [6 + i for i in full], [hashes[i] for i in full]), [True] * 5, "bytes"
            )
            alone = hc.read(store, KV, pool, [hashes[hole]], [6 + hole], io_path)
            assert alone == [False], f"{io_path} get of the page missing its 'v' component alone: {alone}"
        if io_path == "v1":
            per_key = [e for i in idx for e in (True, i != hole)]
            expect_flags(hc.v1(store, IoOp.EXISTS, KV, pool, hashes, idx), per_key, "v1 exists per key")
            expect_flags(hc.v1(store, IoOp.GET, KV, pool, hashes, idx), per_key, "v1 get per key")

    def _write_first_component(
        self, hc: SuiteContext, store: Store, pool: HostPool, page: str, slot: int
    ) -> None:
        """Store only the first component (``k``) of one page: one v1 key, or on a v2-only backend
        a transfer whose ``v`` key belongs to another page (a v2 backend stores under ``keys``)."""
        hc.fill(pool, [slot], [page])
        if hc.caps.v1:
            keys, views = hc.keys_and_views(store, KV, pool, [page], [slot])
            assert store.batch_io_v1(IoOp.SET, keys[:1], views[:1], KV) == [True], "set of one key"
            return
        ((k, _),) = store.page_keys(KV, [page])
        ((_, other),) = store.page_keys(KV, self.make_page_hashes(1, salt=77))
        transfer = PoolTransfer(KV, (slot,), (page,), pool.hit_policy, ((k, other),))
        assert store.batch_io_v2(IoOp.SET, [transfer]) == [[True]], "set of one page"

    @rule("R10", "R14")
    def test_partial_multi_pool(self, hc: SuiteContext) -> None:
        """R10, R14: One v2 call over two pools reports each pool's pages separately."""
        hc.require("v2")
        hc.require_pool(PoolName.INDEXER)
        store, kv = hc.kv_store("mha", 4)
        ix = self.make_indexer_pool(4)
        store.register_pool(PoolName.INDEXER, ix)
        hashes, idx = self.make_page_hashes(4), [0, 1, 2, 3]
        hc.write(store, KV, kv, hashes, idx, path="v2")
        specs = [(KV, kv, hashes, idx), (PoolName.INDEXER, ix, hashes, idx)]
        assert hc.v2(store, IoOp.EXISTS, specs) == [[True] * 4, [False] * 4]
        hc.sentinel(kv, idx)
        assert hc.v2(store, IoOp.GET, specs) == [[True] * 4, [False] * 4]
        expect_flags(hc.matches(kv, idx, hashes), [True] * 4, "kv bytes")

    # -------------------------------------------------------------- isolation
    def _roundtrip_pair(
        self, hc: SuiteContext, a: dict[str, Any], b: dict[str, Any], kind: str = "mha", shared: bool = False
    ) -> None:
        n = 5
        hashes = self.make_page_hashes(n)
        src, dst = list(range(n)), list(range(n, 2 * n))
        pool_a = self.make_kv_pool(kind, 2 * n, layout=a.get("layout", "page_first"))
        pool_b = self.make_kv_pool(kind, 2 * n, layout=b.get("layout", "page_first"))
        ctl_a = hc.controller(pool_a, is_mla_model=kind == "mla", **a)
        ctl_b = hc.controller(pool_b, is_mla_model=kind == "mla", **b)
        hc.fill(pool_a, src, hashes, salt=1)
        assert ctl_a.backup(hashes, src).pages == n
        seen = ctl_b.query(hashes).pages
        if shared and seen == 0 and not (hc.caps.shared or hc.caps.persistent):
            pytest.skip(
                f"backend {hc.name!r} declares neither capabilities.shared nor capabilities.persistent, and "
                "two stores in one process do not see each other's pages"
            )
        if shared:
            assert seen == n, f"rank-replicated pages written by {a} must be visible to {b}"
            hc.sentinel(pool_b, dst)
            assert ctl_b.prefetch(hashes, dst).pages == n
            expect_flags(hc.matches(pool_b, dst, hashes, salt=1), [True] * n, "shared bytes")
            return
        assert seen == 0, f"pages written under {a} are visible under {b}: keys collide"
        hc.fill(pool_b, src, hashes, salt=2)
        assert ctl_b.backup(hashes, src).pages == n
        for ctl, pool, salt in ((ctl_a, pool_a, 1), (ctl_b, pool_b, 2)):
            hc.sentinel(pool, dst)
            assert ctl.prefetch(hashes, dst).pages == n
            expect_flags(hc.matches(pool, dst, hashes, salt=salt), [True] * n, f"bytes of config salt={salt}")

    @rule("R22")
    def test_isolation_mha_tp_ranks(self, hc: SuiteContext) -> None:
        """R22: MHA pages differ per TP rank: rank 1 never sees (or overwrites) rank 0's pages."""
        self._roundtrip_pair(hc, {"tp_size": 2, "tp_rank": 0}, {"tp_size": 2, "tp_rank": 1})

    @rule("R23")
    def test_isolation_mla_ranks_share(self, hc: SuiteContext) -> None:
        """R23: MLA KV is rank-replicated: rank 0 writes it and rank 1 reads the same pages."""
        self._roundtrip_pair(
            hc, {"tp_size": 2, "tp_rank": 0}, {"tp_size": 2, "tp_rank": 1}, "mla", shared=True
        )

    @rule("R22")
    @pytest.mark.parametrize("field", list(ISOLATION_CASES))
    def test_isolation_config(self, hc: SuiteContext, field: str) -> None:
        """R22: "Two configs that differ in model name, model revision, KV dtype, layout or (for per-rank
        pools) a tp, pp or attn-cp rank or size never share a page: neither sees nor overwrites the
        other's". Two controllers (two stores), one field apart, on MHA KV (per-rank)."""
        if field == "layout" and hc.caps.zero_copy and not hc.caps.v1:
            pytest.skip(f"backend {hc.name!r} is zero-copy v2 only, which needs layout='page_first'")
        a, b = (dict(d) for d in ISOLATION_CASES[field])
        if b.get("model_name") == "@other-model":
            b["model_name"] = hc.model_name + "-other"
        self._roundtrip_pair(hc, a, b)

    @rule("R24")
    def test_isolation_pools(self, hc: SuiteContext) -> None:
        """R24: Pages of one pool are never visible as pages of another pool."""
        store, kv = hc.kv_store("mha", 4)
        others = {
            PoolName.MAMBA: self.make_mamba_pool(4),
            PoolName.INDEXER: self.make_indexer_pool(4),
            PoolName.DRAFT: self.make_draft_pool(4),
        }
        others = {k: v for k, v in others.items() if k in hc.caps.pools}
        if not others:
            pytest.skip(f"backend {hc.name!r} declares only the 'kv' pool")
        for name, pool in others.items():
            store.register_pool(name, pool)
        hashes, idx = self.make_page_hashes(4), [0, 1, 2, 3]
        hc.write(store, KV, kv, hashes, idx)
        for name, pool in others.items():
            expect_flags(
                hc.raw(store, IoOp.EXISTS, name, pool, hashes, idx), [False] * 4, f"{name.value} exists"
            )
            hc.write(store, name, pool, hashes, idx, salt=5)
        expect_flags(hc.read(store, KV, kv, hashes, idx), [True] * 4, "kv get")
        expect_flags(hc.matches(kv, idx, hashes), [True] * 4, "kv bytes after writing other pools")

    @rule("R24", "R35")
    def test_isolation_draft(self, hc: SuiteContext) -> None:
        """R24, R35: Draft pages live in their own key space: they never satisfy a target KV query."""
        if hc.caps.draft_io is DraftIoMode.UNSUPPORTED:
            pytest.skip(f"backend {hc.name!r} declares draft_io='unsupported'")
        n = 5
        kv, draft = self.make_kv_pool("mha", 2 * n), self.make_draft_pool(2 * n)
        ctl = hc.controller(HostPoolGroup(kv, {PoolName.DRAFT: draft}))
        hashes, src = self.make_page_hashes(n), list(range(n))
        path = "v2" if hc.caps.draft_io is DraftIoMode.ZERO_COPY_V2 else "v1"
        hc.write(ctl.store, PoolName.DRAFT, draft, hashes, src, salt=9, path=path)
        assert ctl.query(hashes).pages == 0, "draft pages must not make target KV pages visible"
        hc.fill(kv, src, hashes)
        assert ctl.backup(hashes, src).pages == n
        hc.sentinel(draft, src)
        expect_flags(
            hc.raw(ctl.store, IoOp.GET, PoolName.DRAFT, draft, hashes, src, path), [True] * n, "draft get"
        )
        expect_flags(hc.matches(draft, src, hashes, salt=9), [True] * n, "draft bytes after the KV backup")

    # ------------------------------------------------------------------ bytes
    @rule("R11", "R12")
    def test_bytes_exact_after_get(self, hc: SuiteContext, io_path: str) -> None:
        """R11, R12: Every byte (all-zero, all-0xFF, random) reads back exactly; a get writes nothing but its
        target slots: not the pages around and between them, not another pool (canaries)."""
        store, pool = hc.kv_store("mha", 8)
        others = {n: p for n, p in self._other_pools(8).items() if n in hc.caps.pools}
        for name, other in others.items():
            store.register_pool(name, other)
        hashes, idx = self.make_page_hashes(8), list(range(8))
        hc.fill(pool, idx, hashes)
        for value, page in ((0x00, 0), (0xFF, 1)):
            for view in pool.page_views([page])[0]:
                view.fill_(value)
        assert all(hc.raw(store, IoOp.SET, KV, pool, hashes, idx, io_path))
        for name, other in others.items():
            hc.write(store, name, other, hashes, idx, salt=4, path=io_path)
        expected = [[v.clone() for v in views] for views in pool.page_views(idx)]
        before = {name: [b.clone() for b in other.buffers()] for name, other in others.items()}
        wanted = [0, 1, 3, 6]
        hc.sentinel(pool, idx)
        assert all(hc.raw(store, IoOp.GET, KV, pool, [hashes[i] for i in wanted], wanted, io_path))
        for i, views in zip(idx, pool.page_views(idx)):
            for comp, view, exp in zip(pool.components, views, expected[i]):
                if i in wanted:
                    assert bool((view == exp).all()), f"page {i} component {comp!r}: bytes differ after get"
                else:
                    assert bool((view == SENTINEL).all()), (
                        f"get wrote into page {i} ({comp!r}), not requested"
                    )
        for name, other in others.items():
            same = all(bool((a == b).all()) for a, b in zip(before[name], other.buffers()))
            assert same, f"a {io_path} get of kv pages wrote into the {name.value!r} pool"

    def _other_pools(self, n: int) -> dict[PoolName, HostPool]:
        return {
            PoolName.MAMBA: self.make_mamba_pool(n),
            PoolName.INDEXER: self.make_indexer_pool(n),
            PoolName.DRAFT: self.make_draft_pool(n),
        }

    # ------------------------------------------------------------------ clear
    @rule("R26", "R27")
    def test_clear_removes_only_namespace(self, hc: SuiteContext, io_path: str) -> None:
        """R26, R27: ``hicache_clear`` removes this namespace only: afterwards exists, get (even of pages just
        read, which a read cache may hold) and prefetch miss; new bytes are served after it."""
        hc.require_hook("hicache_clear")
        path = io_path
        store_a, pool_a = hc.kv_store("mha", 6)
        store_b, pool_b = hc.kv_store("mha", 6, model_name=hc.model_name + "-keep")
        hashes, idx = self.make_page_hashes(6), list(range(6))
        hc.write(store_a, KV, pool_a, hashes, idx, salt=1, path=path)
        hc.write(store_b, KV, pool_b, hashes, idx, salt=2, path=path)
        expect_flags(hc.read(store_a, KV, pool_a, hashes, idx, path), [True] * 6, "get before clear")
        removed = store_a.clear()
        assert removed > 0, f"clear() returned {removed} after 6 pages were stored"
        expect_flags(
            hc.raw(store_a, IoOp.EXISTS, KV, pool_a, hashes, idx, path), [False] * 6, "exists after clear"
        )
        got = hc.read(store_a, KV, pool_a, hashes, idx, path)
        expect_flags(
            got, [False] * 6, f"{path} get after clear (a read served after clear, e.g. from a cache)"
        )
        ctl = hc.controller(self.make_kv_pool("mha", 6), path=path)
        assert ctl.query(hashes).pages == 0, "query after clear"
        assert ctl.prefetch(hashes, idx).pages == 0, "prefetch after clear"
        expect_flags(
            hc.read(store_b, KV, pool_b, hashes, idx, path), [True] * 6, "other namespace after clear"
        )
        expect_flags(hc.matches(pool_b, idx, hashes, salt=2), [True] * 6, "other namespace bytes")
        hc.write(store_a, KV, pool_a, hashes, idx, salt=3, path=path)
        expect_flags(hc.read(store_a, KV, pool_a, hashes, idx, path), [True] * 6, "get after clear + set")
        expect_flags(hc.matches(pool_a, idx, hashes, salt=3), [True] * 6, "new bytes after clear + set")

    @rule("R26")
    def test_clear_keeps_a_longer_namespace(self, hc: SuiteContext, io_path: str) -> None:
        """R26: clearing a namespace keeps a namespace that merely starts with it (keys match on
        ``namespace + "."``, never on the bare prefix)."""
        hc.require_hook("hicache_clear")
        store_a, pool_a = hc.kv_store("mha", 3, model_name="r26")
        ns = store_a.keys.scheme.namespace
        # The default scheme's namespace begins with the model name's slug, so this model's
        # namespace is ns followed by more characters.
        store_b, pool_b = hc.kv_store("mha", 3, model_name=ns + "x")
        ns_b = store_b.keys.scheme.namespace
        if not ns_b.startswith(ns):
            pytest.skip(f"backend {hc.name!r}: its key scheme gives no namespace that extends {ns!r}")
        hashes, idx = self.make_page_hashes(3), list(range(3))
        hc.write(store_a, KV, pool_a, hashes, idx, salt=1, path=io_path)
        hc.write(store_b, KV, pool_b, hashes, idx, salt=2, path=io_path)
        assert store_a.clear() > 0, "clear() removed nothing after 3 pages were stored"
        expect_flags(
            hc.read(store_b, KV, pool_b, hashes, idx, io_path),
            [True] * 3,
            f"namespace {ns_b!r} after clearing {ns!r} (a prefix match without the trailing '.')",
        )
        expect_flags(hc.matches(pool_b, idx, hashes, salt=2), [True] * 3, "the longer namespace's bytes")
