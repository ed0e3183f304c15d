"""Groups ``persistence``, ``shared`` and ``errors``."""

from __future__ import annotations

import os
import sys

import pytest

from hicache_core import (
    BackendNotFoundError,
    BatchShapeError,
    HiCacheError,
    IoOp,
    KeyFormatError,
    MHAKVPool,
    PoolError,
    PoolName,
    PoolTransfer,
    open_store,
)

from ._base import SuiteBase
from ._child import Child
from ._context import SuiteContext, expect_flags, tensor_digest
from ._rules import rule

__all__ = ["LifecycleTests"]

KV = PoolName.KV
CHILD_TIMEOUT_S = 120


class LifecycleTests(SuiteBase):
    """Reopen, a second process, and bad input."""

    # ------------------------------------------------------------ persistence
    @rule("R28")
    def test_persistence_reopen(self, hc: SuiteContext, io_path: str) -> None:
        """R28: Pages survive closing the store and opening a new one on the same options."""
        hc.require("persistent")
        n = 13
        store, pool = hc.kv_store("mha", n)
        hashes, idx = self.make_page_hashes(n), list(range(n))
        hc.write(store, KV, pool, hashes, idx, path=io_path)
        store.close()
        again, pool2 = hc.kv_store("mha", n)
        found = hc.raw(again, IoOp.EXISTS, KV, pool2, hashes, idx, io_path)
        assert all(found), hc.declared(
            "persistent", f"{io_path}: {found.count(False)} of {n} pages missing after reopen"
        )
        got = hc.read(again, KV, pool2, hashes, idx, io_path)
        assert all(got), hc.declared("persistent", f"{io_path} get after reopen: {got}")
        expect_flags(hc.matches(pool2, idx, hashes), [True] * n, "bytes after reopen")
        again.close()
        ctl = hc.controller(self.make_kv_pool("mha", 2 * n), path=io_path)
        assert ctl.query(hashes).pages == n, hc.declared(
            "persistent", "a new controller cannot see the pages"
        )
        dst = list(range(n, 2 * n))
        assert ctl.prefetch(hashes, dst).pages == n, hc.declared("persistent", "prefetch after reopen")
        expect_flags(hc.matches(ctl.pools.anchor, dst, hashes), [True] * n, "prefetched bytes after reopen")

    # ----------------------------------------------------------------- shared
    @rule("R30")
    def test_shared_two_processes(self, hc: SuiteContext) -> None:
        """R30: Another process opening the same backend + options reads our pages, and we read its pages."""
        hc.require("shared")
        n = 6
        geo = {
            "page_size": self.page_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.kv_dtype).removeprefix("torch."),
        }
        pool = MHAKVPool(2 * n, self.page_size, self.num_layers, self.num_heads, self.head_dim, self.kv_dtype)
        store = hc.open()
        store.register_pool(KV, pool)
        ours, theirs = self.make_page_hashes(n), self.make_page_hashes(n, salt=1)
        idx, dst = list(range(n)), list(range(n, 2 * n))
        hc.write(store, KV, pool, ours, idx)
        expected = [[tensor_digest(v) for v in views] for views in pool.page_views(idx)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        setup = {"config": hc.config().model_dump(mode="json"), "geometry": geo, "pages": n}
        with Child(setup, env, CHILD_TIMEOUT_S) as child:
            seen = child.call("read", ours)
            assert seen["exists"] == [True] * n, hc.declared(
                "shared", f"the other process sees {seen['exists']}"
            )
            assert seen["get"] == [True] * n, hc.declared("shared", f"the other process got {seen['get']}")
            assert seen["digests"] == expected, hc.declared(
                "shared", "the other process read different bytes"
            )
            wrote = child.call("write", theirs)
            assert wrote["set"] == [True] * n, f"the other process failed to write: {wrote['set']}"
            got = hc.read(store, KV, pool, theirs, dst)  # while the writer is still running
            assert got == [True] * n, hc.declared("shared", f"pages written by the other process: get {got}")
            digests = [[tensor_digest(v) for v in views] for views in pool.page_views(dst)]
            assert digests == wrote["digests"], hc.declared(
                "shared", "pages written by the other process differ"
            )

    # ----------------------------------------------------------------- errors
    @rule("R21", "R37")
    def test_errors_bad_page_hash(self, hc: SuiteContext) -> None:
        """R21, R37: Unsafe or malformed page hashes raise ``KeyFormatError`` (also from a key override)."""
        store, _ = hc.kv_store("mha", 2)
        ctl = hc.controller(self.make_kv_pool("mha", 2))
        for bad in ("../etc", "a/b", "", "x" * 200, "a b", "a\x00b"):
            with pytest.raises(KeyFormatError):
                store.page_keys(KV, [bad])
            with pytest.raises(KeyFormatError):
                ctl.backup([bad], [0])
        with pytest.raises(KeyFormatError):
            store.page_keys(KV, [123])  # type: ignore[list-item]

    @rule("R37")
    def test_errors_batch_shape(self, hc: SuiteContext) -> None:
        """R37: Mismatched lengths and out-of-range host pages raise ``BatchShapeError``."""
        store, pool = hc.kv_store("mha", 3)
        hashes = self.make_page_hashes(3)
        if hc.caps.v1:
            keys, views = hc.keys_and_views(store, KV, pool, hashes, [0, 1, 2])
            with pytest.raises(BatchShapeError):
                store.batch_io_v1(IoOp.GET, keys, views[:-1])
            with pytest.raises(BatchShapeError):
                store.batch_io_v1(IoOp.SET, keys, None)
        with pytest.raises(BatchShapeError):
            PoolTransfer(KV, (0, 1), tuple(hashes))
        ctl = hc.controller(self.make_kv_pool("mha", 3))
        with pytest.raises(BatchShapeError):
            ctl.backup(hashes, [0, 1])
        with pytest.raises(BatchShapeError):
            ctl.prefetch(hashes, [0, 1, 3])

    @rule("R6", "R21", "R37")
    def test_errors_unregistered_pool(self, hc: SuiteContext) -> None:
        """R6, R21, R37: I/O on a pool that was never registered (or is unsupported) raises ``PoolError``."""
        store, _ = hc.kv_store("mha", 2)
        hashes = self.make_page_hashes(2)
        with pytest.raises(PoolError):
            store.page_keys(PoolName.INDEXER, hashes)
        if hc.caps.v2:
            with pytest.raises(PoolError):
                store.batch_io_v2(IoOp.EXISTS, [PoolTransfer(PoolName.INDEXER, (0, 1), tuple(hashes))])
        unsupported = [p for p in PoolName if p not in hc.caps.pools]
        if unsupported:
            with pytest.raises(PoolError):
                store.register_pool(unsupported[0], self.make_indexer_pool(2))

    @rule("R37")
    def test_errors_unknown_backend(self, hc: SuiteContext) -> None:
        """R37: An unknown backend name raises ``BackendNotFoundError`` listing this backend."""
        with pytest.raises(BackendNotFoundError) as info:
            open_store(hc.config(backend=hc.name + "-no-such-backend"))
        assert hc.name in str(info.value)
        assert isinstance(info.value, HiCacheError)
