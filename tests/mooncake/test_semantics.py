"""Store-level semantics on the real store: per-page facts, overwrite, chunking, v1 paths, clear."""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hicache_mooncake.testing import MooncakeMaster
from mooncake_helpers import embedded_options, fill, make_config, make_group, rand_hashes, roundtrip

from hicache_core import (
    BatchShapeError,
    CacheController,
    DraftIoMode,
    DraftOffloadDisabledWarning,
    IoOp,
    MHAKVPool,
    MLAKVPool,
    PoolError,
    PoolName,
    PoolTransfer,
    Store,
    open_store,
)


def _transfer(store: Store, name: PoolName, idx: list[int], hashes: list[str]) -> PoolTransfer:
    return PoolTransfer(name, tuple(idx), tuple(hashes), keys=tuple(store.page_keys(name, hashes)))


@pytest.fixture
def store_mha(mode_opts: dict[str, Any]) -> Iterator[tuple[Store, MHAKVPool]]:
    store = open_store(make_config(mode_opts))
    pool = MHAKVPool(16, 4, 2, 2, 8, allocate=False)
    pool.bind(store.alloc_host_memory(pool.nbytes))
    store.register_pool(PoolName.KV, pool)
    yield store, pool
    store.close()


def test_per_page_facts(store_mha: tuple[Store, MHAKVPool]) -> None:
    store, pool = store_mha
    for b in pool.buffers():
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
    hashes = rand_hashes(6)
    kv = PoolName.KV
    assert store.batch_io_v2(IoOp.SET, [_transfer(store, kv, [0, 1, 3], [hashes[i] for i in (0, 1, 3)])]) == [
        [True] * 3
    ]
    # only the k object of page 4: the page is not present
    k4 = store.page_keys(kv, [hashes[4]])[0][0]
    assert store.batch_io_v1(IoOp.SET, [k4], [pool.page_views([4])[0][0]]) == [True]
    exists = store.batch_io_v2(IoOp.EXISTS, [_transfer(store, kv, list(range(6)), hashes)])
    assert exists == [[True, True, False, True, False, False]]
    before = [b.clone() for b in pool.buffers()]
    for b in pool.buffers():
        b.zero_()
    got = store.batch_io_v2(IoOp.GET, [_transfer(store, kv, [10, 11, 12, 13], hashes[:4])])
    assert got == [[True, True, False, True]]  # a missing page is never reported read
    for b, ref in zip(pool.buffers(), before):
        assert torch.equal(b[10], ref[0]) and torch.equal(b[11], ref[1]) and torch.equal(b[13], ref[3])
    # empty batches
    assert store.batch_io_v2(IoOp.GET, []) == []
    assert store.batch_io_v2(IoOp.EXISTS, [_transfer(store, kv, [], [])]) == [[]]
    assert store.batch_io_v1(IoOp.EXISTS, []) == []


def test_bad_input_is_typed(store_mha: tuple[Store, MHAKVPool]) -> None:
    store, _ = store_mha
    hashes = rand_hashes(2)
    with pytest.raises(PoolError):
        store.batch_io_v2(IoOp.GET, [PoolTransfer(PoolName.MAMBA, (0,), (hashes[0],), keys=(("x", "y"),))])
    no_keys = PoolTransfer(PoolName.KV, (0, 1), tuple(hashes))
    with pytest.raises(BatchShapeError, match="page_keys"):
        store.batch_io_v2(IoOp.SET, [no_keys])
    with pytest.raises(BatchShapeError, match="out of range"):
        store.batch_io_v2(IoOp.SET, [_transfer(store, PoolName.KV, [0, 99], hashes)])
    with pytest.raises(BatchShapeError):
        store.batch_io_v1(IoOp.GET, ["a", "b"], [torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(BatchShapeError, match="uint8"):
        store.batch_io_v1(IoOp.SET, ["a"], [torch.zeros(4, dtype=torch.float32)])


def test_v1_foreign_buffers_chunking_and_size_mismatch(mode_opts: dict[str, Any]) -> None:
    """Plain torch tensors (not registered) go through the bounce buffer; > 2048 keys are chunked."""
    with open_store(make_config({**mode_opts, "staging_buffer_size": "1MB"})) as store:
        n = 2500
        src = torch.randint(0, 256, (n, 1000), dtype=torch.uint8)
        keys = [f"{store.keys.scheme.namespace}.raw.x.all.{h}" for h in rand_hashes(n)]
        assert store.batch_io_v1(IoOp.SET, keys, list(src)) == [True] * n
        assert store.batch_io_v1(IoOp.EXISTS, [*keys, keys[0] + "absent"]) == [True] * n + [False]
        dst = torch.zeros_like(src)
        assert store.batch_io_v1(IoOp.GET, keys, list(dst)) == [True] * n
        assert torch.equal(src, dst)
        # a non-contiguous view is copied too
        t = torch.randint(0, 256, (8, 6), dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.SET, [keys[0] + "t"], [t.t()]) == [True]
        out = torch.zeros(6, 8, dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.GET, [keys[0] + "t"], [out]) == [True]
        assert torch.equal(out, t.t())
        # a stored object of another size is a miss and the buffer is left untouched
        for size in (999, 1001):
            wrong = torch.full((size,), 7, dtype=torch.uint8)
            assert store.batch_io_v1(IoOp.GET, [keys[1]], [wrong]) == [False]
            assert bool((wrong == 7).all())
        assert store.clear() >= n


def test_overwrite_semantics(mooncake_master: MooncakeMaster) -> None:
    """put keeps an existing key (content-addressed pages); overwrite=True replaces it."""
    opts = embedded_options(mooncake_master)
    cfg = make_config(opts)
    hashes = rand_hashes(2)
    with open_store(cfg) as store:
        pool = MLAKVPool(4, 4, 2, 8, allocate=True)
        store.register_pool(PoolName.KV, pool)
        t = _transfer(store, PoolName.KV, [0, 1], hashes)
        pool.buffers()[0].fill_(1)
        assert store.batch_io_v2(IoOp.SET, [t]) == [[True, True]]
        pool.buffers()[0].fill_(2)
        assert store.batch_io_v2(IoOp.SET, [t]) == [[True, True]]  # kept: reported present
        assert store.batch_io_v2(IoOp.GET, [t]) == [[True, True]]
        assert bool((pool.buffers()[0][:2] == 1).all())  # the stored (old) bytes, never a mix
    with open_store(cfg.model_copy(update={"options": {**opts, "overwrite": True}})) as store:
        pool = MLAKVPool(4, 4, 2, 8, allocate=True)
        store.register_pool(PoolName.KV, pool)
        t = _transfer(store, PoolName.KV, [0, 1], hashes)
        pool.buffers()[0].fill_(3)
        assert store.batch_io_v2(IoOp.SET, [t]) == [[True, True]]
        pool.buffers()[0].zero_()
        assert store.batch_io_v2(IoOp.GET, [t]) == [[True, True]]
        assert bool((pool.buffers()[0][:2] == 3).all())  # replaced
        assert store.clear() == 2


def _counted(calls: list[str], real: Any, keys: Any) -> Any:
    calls.append("exists")
    return real(keys)


def test_backup_existence_pass_follows_set_skips_existing(mooncake_master: MooncakeMaster) -> None:
    """Default: SET keeps stored objects, so backup skips its batch_is_exist round trip (and its
    skipped count); with overwrite=True the store narrows the capability and backup checks first."""
    opts = embedded_options(mooncake_master)
    hashes = rand_hashes(3)
    for overwrite in (False, True):
        cfg = make_config({**opts, "overwrite": overwrite}, "mla")
        group = make_group("mla")
        with CacheController(cfg, group) as ctl:
            assert type(ctl.store.backend).capabilities.set_skips_existing
            assert ctl.store.capabilities.set_skips_existing is not overwrite
            calls: list[str] = []
            link = ctl.store.backend.link
            real_exists = link.exists
            link.exists = functools.partial(_counted, calls, real_exists)  # type: ignore[method-assign]
            fill(group, 5)
            first = ctl.backup(hashes, [0, 1, 2])
            fill(group, 6)  # other bytes under the same keys: the stored objects must win
            again = ctl.backup(hashes, [0, 1, 2])
            assert first.ok and again.ok and first.pages == again.pages == 3
            assert calls == (["exists", "exists"] if overwrite else [])
            assert again.skipped == (3 if overwrite else 0)
            got = ctl.prefetch(hashes, [4, 5, 6])
            assert got.pages == 3
            ref = make_group("mla", allocate=True)
            fill(ref, 5)
            assert torch.equal(group.anchor.buffers()[0][4:7], ref.anchor.buffers()[0][0:3])
            ctl.clear()


def test_clear_only_own_namespace_and_chunked_v2(mooncake_master: MooncakeMaster) -> None:
    opts = embedded_options(mooncake_master, max_keys_per_call=5)  # force many chunks per call
    cfg_a, cfg_b = make_config(opts), make_config(opts)
    with open_store(cfg_a) as a, open_store(cfg_b) as b:
        hashes = rand_hashes(9)
        for store in (a, b):
            pool = MHAKVPool(12, 4, 1, 1, 8, allocate=True)
            store.register_pool(PoolName.KV, pool)
            assert store.batch_io_v2(IoOp.SET, [_transfer(store, PoolName.KV, list(range(9)), hashes)]) == [
                [True] * 9
            ]
        assert a.clear() == 18
        assert a.batch_io_v2(IoOp.EXISTS, [_transfer(a, PoolName.KV, list(range(9)), hashes)]) == [
            [False] * 9
        ]
        assert b.batch_io_v2(IoOp.EXISTS, [_transfer(b, PoolName.KV, list(range(9)), hashes)]) == [[True] * 9]
        assert b.clear() == 18


def test_split_heads_disables_draft_keeps_target(embedded_opts: dict[str, Any]) -> None:
    group = make_group("draft")
    cfg = make_config(embedded_opts, "draft", should_split_heads=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctl = CacheController(cfg, group)
    with ctl:
        assert ctl.store.draft_io().mode is DraftIoMode.UNSUPPORTED
        assert not ctl.draft_enabled
        assert any(issubclass(w.category, DraftOffloadDisabledWarning) for w in caught)
        fill(group, 3)
        hashes = rand_hashes(4)
        res = ctl.backup(hashes, [0, 1, 2, 3])
        assert res.ok and res.pages == 4 and res.draft is None


def test_mla_rank_replicated_only_rank0_writes(embedded_opts: dict[str, Any]) -> None:
    base = make_config(embedded_opts, "mla", tp_size=2)
    hashes = rand_hashes(5)
    g1, g0 = make_group("mla"), make_group("mla")
    with CacheController(base.model_copy(update={"tp_rank": 1}), g1) as r1:
        fill(g1, 11)
        res = r1.backup(hashes, list(range(5)))
        assert res.skipped == 5 and res.pages == 5  # rank 1 never writes replicated MLA pages
        assert r1.query(hashes).pages == 0
        # embedded mode: objects live in the segments of open stores, so keep rank 0 open
        with CacheController(base, g0) as r0:
            fill(g0, 12)
            assert r0.backup(hashes, list(range(5))).ok
            got = r1.prefetch(hashes, list(range(10, 15)))
            assert got.pages == 5
            assert torch.equal(g1.anchor.buffers()[0][10:15], g0.anchor.buffers()[0][:5])


def test_standalone_foreign_pool_memory_still_works(standalone_opts: dict[str, Any]) -> None:
    """Pools in plain torch memory cannot be registered in standalone mode: they are bounced."""
    group = make_group("mamba", allocate=True)
    with CacheController(make_config(standalone_opts, "mamba"), group) as ctl:
        backend = ctl.store.backend
        assert not any(p.direct for p in backend._pools.values())
        roundtrip(ctl, group)


def test_reregistering_a_pool_releases_the_old_memory(embedded_opts: dict[str, Any]) -> None:
    with open_store(make_config(embedded_opts)) as store:
        link = store.backend.link
        first = MHAKVPool(4, 4, 1, 1, 8, allocate=True)
        store.register_pool(PoolName.KV, first)
        ptr = first.buffers()[0].data_ptr()
        assert link.covers(ptr, 8)
        second = MHAKVPool(4, 4, 1, 1, 8, allocate=True)
        store.register_pool(PoolName.KV, second)
        assert not link.covers(ptr, 8) and link.covers(second.buffers()[0].data_ptr(), 8)


def test_concurrent_puts_of_the_same_pages_report_only_visible_pages(mooncake_master: MooncakeMaster) -> None:
    """A put of a key whose first put is still in flight returns 0 at once in Mooncake; the plugin
    waits for that put instead, so a page reported stored is always readable."""
    with open_store(make_config(embedded_options(mooncake_master))) as store:
        pool = MLAKVPool(64, 1, 1, 64 << 10, torch.uint8, allocate=True)
        store.register_pool(PoolName.KV, pool)
        fill_bytes = torch.randint(0, 256, pool.buffers()[0].shape, dtype=torch.uint8)
        pool.buffers()[0].copy_(fill_bytes)
        problems: list[str] = []
        for _ in range(3):
            hashes = rand_hashes(64)
            t = _transfer(store, PoolName.KV, list(range(64)), hashes)
            start = threading.Barrier(4)

            def worker(t: PoolTransfer = t, start: threading.Barrier = start) -> None:
                start.wait()
                ok = store.batch_io_v2(IoOp.SET, [t])[0]
                seen = store.batch_io_v2(IoOp.EXISTS, [t])[0]
                if any(o and not s for o, s in zip(ok, seen)):
                    problems.append(
                        f"reported stored but not visible: {ok.count(True)} vs {seen.count(True)}"
                    )

            threads = [threading.Thread(target=worker) for _ in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout=60)
        assert not problems, problems


def test_shared_memory_of_closed_stores_is_reused(mooncake_standalone: Any) -> None:
    """Mooncake cannot free store-owned shared memory (standalone mode): a region whose tensors are
    all gone is handed out again, so opening and closing stores does not grow the process."""
    import gc

    from hicache_core import StorageConfig, open_store

    config = StorageConfig(backend="mooncake", options=mooncake_standalone.options(load_env=False))
    first = open_store(config)
    mem = first.alloc_host_memory(4 << 20)
    address = mem.data_ptr()
    first.close()
    with open_store(config) as second:
        other = second.alloc_host_memory(4 << 20)
        assert other.data_ptr() != address  # still in use by `mem`: never handed out twice
        freed = {address, other.data_ptr()}
        del mem, other
        gc.collect()
    with open_store(config) as third:
        again = third.alloc_host_memory(4 << 20)
        assert again.data_ptr() in freed  # an unused region comes back
