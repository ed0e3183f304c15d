"""Group ``batch`` (order, repetition and the transfers of one v2 call) and the every-pool,
every-layout test of group ``pools``: rule tests of R6, R8 and R33.

Every test here moves the pages of every pool kind the backend declares, because a rule about
"a batch" or "a pool" holds for each of them, not only for the MHA KV pool most tests use.
"""

from __future__ import annotations

from hicache_core import HostPool, IoOp, Layout, PoolName, PoolTransfer, Store

from ._base import SuiteBase
from ._context import SuiteContext, expect_flags
from ._rules import rule

__all__ = ["BatchTests", "PoolKindTests"]

KV = PoolName.KV
KINDS = ("mha", "mla", "mamba", "indexer", "draft")
LAYOUTS = (Layout.PAGE_FIRST.value, Layout.LAYER_FIRST.value)


class PoolKindTests(SuiteBase):
    """Group ``pools``: each declared pool kind, on both layouts, on each declared path."""

    @rule("R6", "R11", "R33")
    def test_pools_every_kind_every_layout(self, hc: SuiteContext, io_path: str) -> None:
        """R6, R11, R33: R6: "A backend stores every pool kind it declares in `capabilities.pools` (MHA KV, MLA KV,
        Mamba, indexer, draft), on both layouts [...], on every I/O path it declares"; R33: "a `v2`
        backend without [`zero_copy`] also works on `layer_first` pools". Per kind and layout: set,
        exists and get of 5 pages (from and into scattered slots), byte-exact."""
        pools = {PoolName.MAMBA: "mamba", PoolName.INDEXER: "indexer", PoolName.DRAFT: "draft"}
        kinds = ["mha", "mla", *(kind for name, kind in pools.items() if name in hc.caps.pools)]
        checked: list[str] = []
        for layout in LAYOUTS:
            if layout == Layout.LAYER_FIRST.value and io_path == "v2" and hc.caps.zero_copy:
                continue  # R33: a zero-copy v2 path may require page_first pools
            for kind in kinds:
                store, name, pool = self._kind_store(hc, kind, layout)
                hashes = self.make_page_hashes(5, salt=KINDS.index(kind))
                src, dst = [6, 1, 9, 3, 0], [2, 8, 4, 7, 5]
                what = f"{kind} pool, {layout}, {io_path}"
                hc.write(store, name, pool, hashes, src, salt=len(checked), path=io_path)
                expect_flags(hc.raw(store, IoOp.EXISTS, name, pool, hashes, src, io_path), [True] * 5, what)
                expect_flags(hc.read(store, name, pool, hashes, dst, io_path), [True] * 5, f"{what}: get")
                got = hc.matches(pool, dst, hashes, salt=len(checked))
                expect_flags(got, [True] * 5, f"{what}: bytes after get")
                checked.append(what)
        assert checked

    @rule("R11", "R14", "R17")
    def test_pools_cross_path(self, hc: SuiteContext) -> None:
        """R11, R14, R17: a backend declaring v1 and v2 stores the same objects on both paths (the
        controller moves pages over v2, and over v1 when it stages, e.g. with ``io_timeout_s``): per
        declared pool kind and layout, pages set over one path exist and read back byte-exact over
        the other, both ways."""
        hc.require("v1")
        hc.require("v2")
        pools = {PoolName.MAMBA: "mamba", PoolName.INDEXER: "indexer", PoolName.DRAFT: "draft"}
        kinds = ["mha", "mla", *(kind for name, kind in pools.items() if name in hc.caps.pools)]
        checked: list[str] = []
        for layout in LAYOUTS:
            if layout == Layout.LAYER_FIRST.value and hc.caps.zero_copy:
                continue  # R33: a zero-copy v2 path may require page_first pools
            for kind in kinds:
                store, name, pool = self._kind_store(hc, kind, layout)
                for written, read in (("v1", "v2"), ("v2", "v1")):
                    hashes = self.make_page_hashes(3, salt=100 + len(checked))
                    what = f"{kind} pool, {layout}, set over {written}, read over {read}"
                    hc.write(store, name, pool, hashes, [6, 1, 9], salt=len(checked), path=written)
                    try:
                        expect_flags(
                            hc.raw(store, IoOp.EXISTS, name, pool, hashes, [6, 1, 9], read),
                            [True] * 3,
                            f"{what}: exists",
                        )
                        expect_flags(
                            hc.read(store, name, pool, hashes, [2, 8, 4], read), [True] * 3, f"{what}: get"
                        )
                        got = hc.matches(pool, [2, 8, 4], hashes, salt=len(checked))
                        expect_flags(got, [True] * 3, f"{what}: bytes after get")
                    except AssertionError as err:
                        raise AssertionError(
                            f"R11/R17: backend {hc.name!r} declares v1 and v2 but its paths disagree: {err}. "
                            "Both paths must store one object per component key with the bytes in "
                            "logical (row-major) order, whatever the pool or layout"
                        ) from None
                    checked.append(what)
        assert checked

    def _kind_store(self, hc: SuiteContext, kind: str, layout: str) -> tuple[Store, PoolName, HostPool]:
        """A store (config with this layout; MLA for ``mla``) with one pool of ``kind`` registered."""
        store = hc.open(layout=layout, is_mla_model=kind == "mla")
        if kind in ("mha", "mla"):
            name, pool = KV, self.make_kv_pool(kind, 10, layout=layout)
        elif kind == "mamba":
            name, pool = PoolName.MAMBA, self.make_mamba_pool(10, layout=layout)
        elif kind == "indexer":
            name, pool = PoolName.INDEXER, self.make_indexer_pool(10, layout=layout)
        else:
            name, pool = PoolName.DRAFT, self.make_draft_pool(10, layout=layout)
        if name is not KV:
            store.register_pool(KV, self.make_kv_pool("mha", 10, layout=layout))
        store.register_pool(name, pool)
        return store, name, pool


class BatchTests(SuiteBase):
    """Group ``batch``: results stay positional whatever the order and repetition in a batch."""

    @rule("R8", "R10", "R11")
    def test_batch_order_and_repetition(self, hc: SuiteContext, io_path: str) -> None:
        """R8, R10, R11: R8: "result `i` answers input `i` (for v2, `host_indices[i]` is the host slot of page `i`),
        whatever the order of the keys, pages and transfers, and when a key or page repeats in a GET
        or EXISTS batch". For every declared pool: pages set from slots in descending order, then
        EXISTS and GET of a batch that mixes stored and absent pages out of order, one page twice,
        into scattered slots; each position gets its own answer and its own bytes."""
        store = hc.open()
        pools = self.declared_pools(hc.caps.pools, 16)
        for name, pool in pools.items():
            store.register_pool(name, pool)
        hashes = self.make_page_hashes(8, salt=41)
        stored = [5, 3, 0, 6, 1]  # pages set, from slots 15, 14, 13, 12, 11
        for salt, (name, pool) in enumerate(pools.items()):
            what = f"{io_path} {name.value}"
            hc.write(store, name, pool, [hashes[p] for p in stored], [15, 14, 13, 12, 11], salt, io_path)
            asked = [6, 2, 0, 6, 7, 3, 5, 0]  # out of order, absent pages 2 and 7, pages 6 and 0 twice
            expected = [p in stored for p in asked]
            sel = [hashes[p] for p in asked]
            dst = [9, 1, 7, 4, 0, 8, 2, 5]
            expect_flags(
                hc.raw(store, IoOp.EXISTS, name, pool, sel, dst, io_path), expected, f"{what} exists"
            )
            expect_flags(hc.read(store, name, pool, sel, dst, io_path), expected, f"{what} get")
            hits = [i for i, e in enumerate(expected) if e]
            got = hc.matches(pool, [dst[i] for i in hits], [sel[i] for i in hits], salt)
            expect_flags(got, [True] * len(hits), f"{what}: bytes in each slot of a scattered, repeating get")

    @rule("R8", "R14")
    def test_batch_transfers_any_order(self, hc: SuiteContext) -> None:
        """R8, R14: R8: "one list per `PoolTransfer` with one bool per page (v2), and result `i` answers input
        `i` [...] whatever the order of the keys, pages and transfers". One v2 call carries the same
        pool twice (different pages, different lengths) and the declared pools in an order other than
        the one they were registered in; each transfer gets its own answers and bytes."""
        hc.require("v2")
        store = hc.open()
        pools = self.declared_pools(hc.caps.pools, 16)
        for name, pool in pools.items():
            store.register_pool(name, pool)
        hashes = self.make_page_hashes(6, salt=43)
        stored = {name: [p for p in range(6) if (p + i) % 3] for i, name in enumerate(pools)}
        for i, (name, pool) in enumerate(pools.items()):
            hc.write(store, name, pool, [hashes[p] for p in stored[name]], stored[name], salt=i, path="v2")
        # KV three times (2, 3 and 4 pages), every pool in reverse registration order in between
        order: list[tuple[PoolName, list[int]]] = [(KV, [4, 0]), *((n, [5, 2, 1]) for n in reversed(pools))]
        order.append((KV, [3, 5, 1, 2]))
        transfers, dsts, free = [], [], dict.fromkeys(pools, 6)
        for name, pages in order:
            dst = list(range(free[name], free[name] + len(pages)))
            free[name] += len(pages)
            sel = [hashes[p] for p in pages]
            keys = tuple(store.page_keys(name, sel))
            transfers.append(PoolTransfer(name, tuple(dst), tuple(sel), pools[name].hit_policy, keys))
            dsts.append(dst)
        expected = [[p in stored[name] for p in pages] for name, pages in order]
        names = [f"{n.value}{pages}" for n, pages in order]
        for op in (IoOp.EXISTS, IoOp.GET):
            for pool in pools.values():
                hc.sentinel(pool, range(6, 16))
            got = store.batch_io_v2(op, transfers)
            hc.canary.check()
            assert got == expected, f"v2 {op.value} of transfers {names}: got {got}, expected {expected}"
        for k, (name, pages) in enumerate(order):
            hits = [j for j, e in enumerate(expected[k]) if e]
            salt = list(pools).index(name)
            slots, sel = [dsts[k][j] for j in hits], [hashes[pages[j]] for j in hits]
            got_bytes = hc.matches(pools[name], slots, sel, salt)
            expect_flags(got_bytes, [True] * len(hits), f"bytes of transfer {k} ({name.value})")
