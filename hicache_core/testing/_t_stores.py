"""Rules about more than one store on the same storage: other store objects, other processes,
other ranks, a reopen, a process that ends without closing (R26 to R31).

A rule that speaks of processes or other stores is checked with more than one store object on the
same options (both open at once, the second opened before the first writes) or with a second
process (``_child``); a rule that speaks of ranks with two ranks writing at the same time; a rule
that speaks of pools with every pool kind the backend declares.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from hicache_core import HostPool, IoOp, MHAKVPool, PoolName, Store

from ._base import SuiteBase
from ._child import Child
from ._context import SuiteContext, expect_flags, tensor_digest
from ._rules import rule

__all__ = ["StoresTests"]

KV = PoolName.KV
CHILD_TIMEOUT_S = 120
RANK_PAGES = 32  # pages each rank sets, one call per page, while the other rank does the same
START_DELAY_S = 1.0  # time for the child to receive the request and fill its pages
OVERLAPS, OVERLAP_ATTEMPTS = 3, 6  # rounds of concurrent sets whose spans overlapped, rounds at most

Pools = dict[PoolName, HostPool]


class StoresTests(SuiteBase):
    """Groups ``shared``, ``persistence`` and ``clear``: what other stores and processes see."""

    # --------------------------------------------------------------------- helpers
    def _store(self, hc: SuiteContext, n: int, **overrides: Any) -> tuple[Store, Pools]:
        store = hc.open(**overrides)
        pools = self.declared_pools(hc.caps.pools, n)
        for name, pool in pools.items():
            store.register_pool(name, pool)
        return store, pools

    def _write_all(
        self, hc: SuiteContext, store: Store, pools: Pools, hashes: list[str], salt: int, path: str
    ) -> None:
        for i, (name, pool) in enumerate(pools.items()):
            hc.write(store, name, pool, hashes, range(len(hashes)), salt=salt + i, path=path)

    def _seen(
        self,
        hc: SuiteContext,
        store: Store,
        pools: Pools,
        hashes: list[str],
        salt: int | None,
        path: str,
        what: str,
    ) -> None:
        """Every pool of ``store`` reports each page (``salt`` given: present, with those bytes) or
        none of them (``salt`` None), through exists and get."""
        n = len(hashes)
        dst = list(range(n, 2 * n))
        for i, (name, pool) in enumerate(pools.items()):
            want = [salt is not None] * n
            label = f"{what}: {path} {name.value}"
            expect_flags(hc.raw(store, IoOp.EXISTS, name, pool, hashes, dst, path), want, f"{label} exists")
            expect_flags(hc.read(store, name, pool, hashes, dst, path), want, f"{label} get")
            if salt is not None:
                expect_flags(hc.matches(pool, dst, hashes, salt + i), want, f"{label} bytes")

    def _child_setup(self, hc: SuiteContext, pages: int, **overrides: Any) -> dict[str, Any]:
        geo = {
            "page_size": self.page_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.kv_dtype).removeprefix("torch."),
        }
        return {"config": hc.config(**overrides).model_dump(mode="json"), "geometry": geo, "pages": pages}

    @staticmethod
    def _env() -> dict[str, str]:
        return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))

    def _kv(self, hc: SuiteContext, n: int, **overrides: Any) -> tuple[Store, MHAKVPool]:
        pool = MHAKVPool(n, self.page_size, self.num_layers, self.num_heads, self.head_dim, self.kv_dtype)
        store = hc.open(**overrides)
        store.register_pool(KV, pool)
        return store, pool

    # ---------------------------------------------------------------------- shared
    @rule("R30")
    def test_shared_two_stores(self, hc: SuiteContext, io_path: str) -> None:
        """R30: "`shared`: pages written by one store are visible, through exists, get, query and
        prefetch, to every other store opened on the same options, in this process or another, while
        both are open, both ways". Two stores opened before any write, each having looked for the
        pages first; every declared pool; then the other way round."""
        hc.require("shared")
        n = 6
        a, pools_a = self._store(hc, 2 * n)
        kv_b = self.make_kv_pool("mha", 2 * n)
        ctl_b = hc.controller(kv_b, path=io_path)
        b = ctl_b.store
        pools_b: Pools = {KV: kv_b}
        for name, pool in self.declared_pools(hc.caps.pools, 2 * n).items():
            if name is not KV:
                b.register_pool(name, pool)
                pools_b[name] = pool
        ours, theirs = self.make_page_hashes(n, salt=47), self.make_page_hashes(n, salt=48)
        self._seen(hc, b, pools_b, ours, None, io_path, "store B before store A wrote")
        assert ctl_b.query(ours).pages == 0
        self._seen(hc, a, pools_a, theirs, None, io_path, "store A before store B wrote")
        self._write_all(hc, a, pools_a, ours, 1, io_path)
        try:
            self._seen(hc, b, pools_b, ours, 1, io_path, "store B, pages of store A")
        except AssertionError as err:
            raise AssertionError(hc.declared("shared", str(err))) from None
        assert ctl_b.query(ours).pages == n, hc.declared("shared", "store B's query misses store A's pages")
        hc.sentinel(kv_b, range(n, 2 * n))
        got = ctl_b.prefetch(ours, list(range(n, 2 * n))).pages
        assert got == n, hc.declared("shared", f"store B's prefetch of store A's pages restored {got} of {n}")
        expect_flags(hc.matches(kv_b, range(n, 2 * n), ours, 1), [True] * n, "prefetched bytes")
        self._write_all(hc, b, pools_b, theirs, 10, io_path)
        try:
            self._seen(hc, a, pools_a, theirs, 10, io_path, "store A, pages of store B")
        except AssertionError as err:
            raise AssertionError(hc.declared("shared", str(err))) from None

    @rule("R31", "R22")
    def test_shared_concurrent_ranks(self, hc: SuiteContext) -> None:
        """R31, R22: R31: "Processes (such as the ranks of one model) that set pages on `shared` storage at the
        same time never lose each other's pages: every page any of them set is visible afterwards,
        and per-rank pages stay with their rank". Rank 1 (a second process) and rank 0 (this one)
        set the same page hashes (MHA, so per-rank keys and bytes), one call per page, at the same
        time; then a fresh store of each rank reads every page with its own rank's bytes."""
        hc.require("shared")
        n = RANK_PAGES
        ranks = {"tp_size": 2}
        store, pool = self._kv(hc, n, **ranks, tp_rank=0)
        setup = self._child_setup(hc, n, **ranks, tp_rank=1)
        overlapped = 0
        with Child(setup, self._env(), CHILD_TIMEOUT_S) as child:
            # Both ranks start setting at one agreed moment, each having paid its first set's
            # one-time costs before it. On a loaded machine one rank may still finish before the
            # other begins, and overlapping sets interleave only by chance: so rounds (new pages
            # each, checked before the next) run until OVERLAPS of them overlapped in time, at
            # most OVERLAP_ATTEMPTS.
            for attempt in range(OVERLAP_ATTEMPTS):
                hashes = self.make_page_hashes(n, salt=4900 + attempt)
                hc.fill(pool, range(n), hashes)
                start_at = time.time() + START_DELAY_S
                child.send("write", hashes, each=True, start_at=start_at, warm=True)
                hc.raw(store, IoOp.SET, KV, pool, hashes[:1], [0])  # one-time costs before the start
                time.sleep(max(0.0, start_at - time.time()))
                began = time.time()
                ours = [hc.raw(store, IoOp.SET, KV, pool, [h], [i])[0] for i, h in enumerate(hashes)]
                ended = time.time()
                wrote = child.reply()
                assert ours == [True] * n and wrote["set"] == [True] * n, (
                    f"set: rank 0 {ours}, rank 1 {wrote}"
                )
                self._check_ranks(hc, hashes, wrote["digests"], ranks)
                theirs = wrote.get("span") or [began, ended]
                overlapped += max(began, theirs[0]) < min(ended, theirs[1])
                if overlapped >= OVERLAPS:
                    break

    def _check_ranks(
        self, hc: SuiteContext, hashes: list[str], their_digests: list[list[str]], ranks: dict[str, int]
    ) -> None:
        """A fresh store of each rank finds every page of ``hashes`` with its own rank's bytes."""
        n = len(hashes)
        for rank, expected in ((0, None), (1, their_digests)):
            fresh, dst = self._kv(hc, n, **ranks, tp_rank=rank)
            found = hc.raw(fresh, IoOp.EXISTS, KV, dst, hashes, range(n))
            assert all(found), hc.declared(
                "shared",
                f"after ranks 0 and 1 set {n} pages each at the same time, rank {rank} finds only "
                f"{sum(found)} of its pages: a concurrent writer's pages were lost",
            )
            got = hc.read(fresh, KV, dst, hashes, range(n))
            expect_flags(got, [True] * n, f"rank {rank} get")
            if expected is None:
                expect_flags(hc.matches(dst, range(n), hashes), [True] * n, "rank 0 bytes")
            else:
                digests = [[tensor_digest(v) for v in views] for views in dst.page_views(range(n))]
                bad = [i for i in range(n) if digests[i] != expected[i]]
                assert not bad, f"rank 1 reads other bytes than rank 1 wrote for pages {bad[:8]}"

    # ----------------------------------------------------------------- persistence
    @rule("R28")
    def test_persistence_every_pool(self, hc: SuiteContext, io_path: str) -> None:
        """R28: "`persistent`: the pages of every pool the backend declares survive closing the store
        and opening a new one on the same options". Every declared pool, set, closed, reopened."""
        hc.require("persistent")
        n = 5
        hashes = self.make_page_hashes(n, salt=55)
        store, pools = self._store(hc, 2 * n)
        self._write_all(hc, store, pools, hashes, 1, io_path)
        store.close()
        again, pools2 = self._store(hc, 2 * n)
        try:
            self._seen(hc, again, pools2, hashes, 1, io_path, "after reopen")
        except AssertionError as err:
            raise AssertionError(hc.declared("persistent", str(err))) from None

    @rule("R29", "R17")
    def test_persistence_process_exit(self, hc: SuiteContext) -> None:
        """R29, R17: R29: "A `persistent` backend's SET is durable: a page reported `True` survives the process
        that wrote it ending without closing its store". A second process sets pages, is killed
        (SIGKILL: no close, no exit handlers), and a store opened afterwards reads every byte."""
        hc.require("persistent")
        n = 6
        hashes = self.make_page_hashes(n, salt=57)
        with Child(self._child_setup(hc, n), self._env(), CHILD_TIMEOUT_S) as child:
            wrote = child.call("write", hashes)
            child.kill()
        assert wrote["set"] == [True] * n, f"the other process failed to write: {wrote['set']}"
        store, pool = self._kv(hc, n)
        found = hc.raw(store, IoOp.EXISTS, KV, pool, hashes, range(n))
        assert all(found), hc.declared(
            "persistent",
            f"{n - sum(found)} of {n} pages set (True) by a process that was then killed are gone",
        )
        expect_flags(hc.read(store, KV, pool, hashes, range(n)), [True] * n, "get after the writer died")
        digests = [[tensor_digest(v) for v in views] for views in pool.page_views(range(n))]
        assert digests == wrote["digests"], "the pages read differ from those the killed process set"

    # ----------------------------------------------------------------------- clear
    @rule("R26", "R27")
    def test_clear_every_pool_every_store(self, hc: SuiteContext, io_path: str) -> None:
        """R26: "`hicache_clear(namespace)` removes every object whose key starts with `namespace +
        "."`: in every pool, whichever store or process wrote it; other namespaces keep their data";
        R27: "After a clear, no store on that storage reports or serves a cleared page (no cache may
        answer for it) until it is set again". Every declared pool; pages written by this store, by
        another open store (`shared`) and by a store closed before (`persistent`); the clear is made
        by a store that wrote nothing (one store when neither is declared), after the others read."""
        hc.require_hook("hicache_clear")
        n = 5
        shared, persistent = hc.caps.shared, hc.caps.persistent
        a, pools_a = self._store(hc, 2 * n)
        keep, pools_keep = self._store(hc, 2 * n, model_name=hc.model_name + "-keep")
        groups = {"written by this store": self.make_page_hashes(n, salt=51)}
        self._write_all(hc, a, pools_a, groups["written by this store"], 1, io_path)
        self._write_all(hc, keep, pools_keep, groups["written by this store"], 20, io_path)
        viewers: list[tuple[str, Store, Pools]] = []
        if shared:
            b, pools_b = self._store(hc, 2 * n)
            groups["written by another store"] = self.make_page_hashes(n, salt=52)
            self._write_all(hc, b, pools_b, groups["written by another store"], 1, io_path)
            viewers += [("store A", a, pools_a), ("store B", b, pools_b)]
        if persistent:
            c, pools_c = self._store(hc, 2 * n)
            groups["written before a reopen"] = self.make_page_hashes(n, salt=53)
            self._write_all(hc, c, pools_c, groups["written before a reopen"], 1, io_path)
            c.close()
        for _, store, pools in viewers:  # read every page first: a read cache would now hold it
            for hashes in groups.values():
                self._seen(hc, store, pools, hashes, 1, io_path, "before clear")
        if shared or persistent:
            if not shared:
                a.close()  # persistent only: the clearing store opens after the writers closed
            x, pools_x = self._store(hc, 2 * n)
            removed = x.clear()
        else:
            x, pools_x = a, pools_a
            removed = a.clear()
        viewers.append(("the clearing store", x, pools_x))
        for who, store, pools in viewers:
            for what, hashes in groups.items():
                self._seen(hc, store, pools, hashes, None, io_path, f"after clear, {who}, pages {what}")
        if persistent:
            x.close()
            x, pools_x = self._store(hc, 2 * n)
            for what, hashes in groups.items():
                self._seen(hc, x, pools_x, hashes, None, io_path, f"reopened after clear, pages {what}")
            viewers[-1] = ("the clearing store, reopened", x, pools_x)
        ctl = hc.controller(self.make_kv_pool("mha", 2 * n), path=io_path)
        assert ctl.query(groups["written by this store"]).pages == 0, "query after clear"
        assert isinstance(removed, int) and removed > 0, (
            f"clear() returned {removed!r} after pages were stored"
        )
        self._seen(hc, keep, pools_keep, groups["written by this store"], 20, io_path, "other namespace")
        again = groups["written by this store"]
        self._write_all(hc, x, pools_x, again, 30, io_path)
        for who, store, pools in viewers:
            self._seen(hc, store, pools, again, 30, io_path, f"set again after clear, {who}")

    @rule("R17", "R27")
    def test_clear_then_set_again(self, hc: SuiteContext, io_path: str) -> None:
        """R17, R27: R27: "After a clear, no store on that storage reports or serves a cleared page [...]
        until it is set again; then the new bytes are served". Store A sets pages of every declared
        pool, store B (open at the same time, `shared`) clears the namespace, A sets the same pages
        again: a store opened afterwards reads every one (a SET that skipped keys because this store
        wrote them before would publish nothing)."""
        hc.require_hook("hicache_clear")
        hc.require("shared")
        n = 4
        a, pools_a = self._store(hc, 2 * n)
        b, _ = self._store(hc, 2 * n)
        hashes = self.make_page_hashes(n, salt=58)
        self._write_all(hc, a, pools_a, hashes, 1, io_path)
        removed = b.clear()
        assert isinstance(removed, int) and removed > 0, f"store B's clear() returned {removed!r}"
        self._write_all(hc, a, pools_a, hashes, 1, io_path)
        fresh, pools_f = self._store(hc, 2 * n)
        try:
            self._seen(
                hc,
                fresh,
                pools_f,
                hashes,
                1,
                io_path,
                "a new store, pages set again after another store's clear",
            )
        except AssertionError as err:
            raise AssertionError(
                f"R17: backend {hc.name!r}: {err}. SET True means published: after another store's clear, "
                "a SET must store the page again (never skip a key because this store wrote it before; "
                "only the storage can say what is stored)"
            ) from None
