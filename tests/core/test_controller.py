"""CacheController semantics over in-memory test backends declaring each capability."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import hicache_core as hc
from hicache_core import (
    CacheController,
    HostPoolGroup,
    IndexerPool,
    MambaPool,
    MHAKVPool,
    MLAKVPool,
    PoolName,
)
from tests.support import membackend


def fill(group: HostPoolGroup) -> dict:
    g = torch.Generator().manual_seed(1)
    for pool in group.values():
        for b in pool.buffers():
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return {n: [b.clone() for b in p.buffers()] for n, p in group.items()}


def zero(group: HostPoolGroup) -> None:
    for pool in group.values():
        for b in pool.buffers():
            b.zero_()


def hashes(n: int, seed: int = 0) -> list[str]:
    return hc.page_hashes(list(range(seed, seed + 4 * n)), 4)


def mha_group(
    draft: bool = False, mamba: bool = False, mla: bool = False, indexer: bool = False
) -> HostPoolGroup:
    kv = MLAKVPool(32, 4, 2, 16, allocate=False) if mla else MHAKVPool(32, 4, 2, 2, 8, allocate=False)
    extras = {}
    if mamba:
        extras[PoolName.MAMBA] = MambaPool(8, 2, (4, 4), [(3, 4)], allocate=False)
    if indexer:
        extras[PoolName.INDEXER] = IndexerPool(32, 4, 2, 8, allocate=False)
    if draft:
        extras[PoolName.DRAFT] = MHAKVPool(32, 4, 1, 2, 8, allocate=False)
    return HostPoolGroup(kv, extras)


@pytest.mark.parametrize("backend", ["memory", "memory-zc", "memory-nodraft"])
def test_backup_query_prefetch_round_trip(memory_backends, backend: str) -> None:
    group = mha_group()
    with CacheController(hc.StorageConfig(backend=backend, model_name="m"), group) as ctl:
        assert ctl.io_path == ("v1" if backend == "memory-nodraft" else "v2")
        saved = fill(group)
        hs = hashes(10)
        res = ctl.backup(hs, range(10))
        assert res.pages == 10 and res.ok and res.skipped == 0
        assert ctl.query(hs).pages == 10
        zero(group)
        res = ctl.prefetch(hs, range(10, 20))
        assert res.pages == 10
        for name, pool in group.items():
            for b, s in zip(pool.buffers(), saved[name]):
                assert torch.equal(b[10:20], s[:10])
        again = ctl.backup(hs, range(10))
        assert again.skipped == 10 and again.pages == 10


def test_hole_ends_prefix(memory_backends) -> None:
    group = mha_group()
    with CacheController(hc.StorageConfig(backend="memory"), group) as ctl:
        fill(group)
        hs = hashes(8)
        ctl.backup(hs[:3], range(3))
        ctl.backup(hs[4:], range(4, 8))
        assert ctl.query(hs).pages == 3
        assert ctl.prefetch(hs, range(8)).pages == 3


def test_trailing_policy_for_mamba(memory_backends) -> None:
    group = mha_group(mamba=True)
    with CacheController(hc.StorageConfig(backend="memory"), group) as ctl:
        saved = fill(group)
        hs = hashes(6)
        ctl.backup(hs[:4], range(4), {PoolName.MAMBA: [2]})  # state after page 4
        ctl.backup(hs, range(6))  # KV for 6 pages but no state after page 6
        q = ctl.query(hs)
        assert q.per_pool[PoolName.KV] == 6 and q.pages == 4
        zero(group)
        res = ctl.prefetch(hs, range(6), {PoolName.MAMBA: [5]})
        assert res.pages == 4
        assert torch.equal(group[PoolName.MAMBA].buffers()[0][5], saved[PoolName.MAMBA][0][2])


def test_indexer_all_pages(memory_backends) -> None:
    group = mha_group(indexer=True)
    with CacheController(hc.StorageConfig(backend="memory"), group) as ctl:
        fill(group)
        hs = hashes(5)
        ctl.backup(hs, range(5))
        key = ctl.store.page_keys(PoolName.INDEXER, hs[2:3])[0][0]
        del membackend.SHARED[key]
        assert ctl.query(hs).pages == 2


def test_mla_only_rank0_writes(memory_backends) -> None:
    cfg1 = hc.StorageConfig(backend="memory", is_mla_model=True, tp_rank=1, tp_size=2)
    g1 = mha_group(mla=True)
    with CacheController(cfg1, g1) as ctl:
        fill(g1)
        res = ctl.backup(hashes(3), range(3))
        assert res.skipped == 3 and not membackend.SHARED
    cfg0 = cfg1.model_copy(update={"tp_rank": 0})
    g0 = mha_group(mla=True)
    with CacheController(cfg0, g0) as ctl0, CacheController(cfg1, mha_group(mla=True)) as ctl1:
        fill(g0)
        ctl0.backup(hashes(3), range(3))
        assert ctl1.query(hashes(3)).pages == 3  # ranks agree


def test_backend_exception_is_reported_per_page(memory_backends, caplog) -> None:
    group = mha_group()
    cfg = hc.StorageConfig(backend="memory", options={"raise_on": ["kv"]})
    with caplog.at_level(logging.ERROR, logger="hicache"), CacheController(cfg, group) as ctl:
        res = ctl.backup(hashes(3), range(3))
        assert res.pages == 0 and res.per_pool[PoolName.KV] == [False] * 3
        assert res.errors and "'memory'" in res.errors[0] and "injected" in res.errors[0]
        assert ctl.prefetch(hashes(3), range(3)).pages == 0
        fut = ctl.backup_async(hashes(3), range(3))
        assert fut.result().pages == 0  # async worker survives
    assert any("injected" in r.getMessage() for r in caplog.records)


def test_bad_input_is_typed(memory_backends) -> None:
    group = mha_group(mamba=True)
    with CacheController(hc.StorageConfig(backend="memory"), group) as ctl:
        with pytest.raises(hc.BatchShapeError):
            ctl.backup(hashes(3), range(2))
        with pytest.raises(hc.BatchShapeError):
            ctl.backup(hashes(3), [0, 1, 99])
        with pytest.raises(hc.KeyFormatError):
            ctl.backup(["../../etc/passwd"], [0])
        with pytest.raises(hc.PoolError):
            ctl.backup(hashes(1), [0], {PoolName.INDEXER: [0]})
        with pytest.raises(hc.BatchShapeError):
            ctl.backup(hashes(1), [0], {PoolName.MAMBA: [0, 1]})
        with pytest.raises(hc.KeyFormatError):
            ctl.query(["a/b"])
        assert ctl.query([]).pages == 0 and ctl.backup([], []).pages == 0


def test_config_pool_mismatches(memory_backends) -> None:
    with pytest.raises(hc.ConfigError, match="is_mla_model"):
        CacheController(hc.StorageConfig(backend="memory", is_mla_model=True), mha_group())
    with pytest.raises(hc.PoolError, match="layout"):
        CacheController(hc.StorageConfig(backend="memory", layout="layer_first"), mha_group())
    with pytest.raises(hc.PoolError, match="does not support pool 'mamba'"):
        CacheController(hc.StorageConfig(backend="memory-nodraft"), mha_group(mamba=True))


# ---------------------------------------------------------------- draft matrix
@pytest.mark.parametrize(
    ("backend", "split", "expected"),
    [
        ("memory-zc", False, "v2"),
        ("memory-zc", True, None),
        ("memory", False, "v1"),
        ("memory", True, "v1"),
        ("memory-nodraft", False, None),
    ],
)
def test_draft_resolution_follows_declared_capability(
    memory_backends, backend, split, expected, caplog
) -> None:
    group = mha_group(draft=True)
    cfg = hc.StorageConfig(backend=backend, should_split_heads=split)
    with caplog.at_level(logging.WARNING, logger="hicache"):
        if expected is None:
            with pytest.warns(hc.DraftOffloadDisabledWarning) as rec:
                ctl = CacheController(cfg, group)
            assert len(rec) == 1
        else:
            ctl = CacheController(cfg, group)
    with ctl:
        warnings_logged = [r for r in caplog.records if "draft KV offload disabled" in r.getMessage()]
        assert (ctl.draft_path.io_path if ctl.draft_path else None) == expected
        if expected is None:
            assert len(warnings_logged) == 1 and f"'{backend}'" in warnings_logged[0].getMessage()
            if split:
                assert "should_split_heads" in warnings_logged[0].getMessage()
            assert PoolName.DRAFT not in ctl.store.pools
        else:
            assert not warnings_logged
            saved = fill(group)
            hs = hashes(4)
            res = ctl.backup(hs, range(4))
            assert res.draft == [True] * 4
            assert any(".draft." in k for k in membackend.SHARED)
            zero(group)
            res = ctl.prefetch(hs, range(4))
            assert res.draft == [True] * 4 and res.pages == 4
            assert torch.equal(group[PoolName.DRAFT].buffers()[0][:4], saved[PoolName.DRAFT][0][:4])


def test_draft_failure_never_fails_target(memory_backends) -> None:
    group = mha_group(draft=True)
    cfg = hc.StorageConfig(backend="memory-zc", options={"raise_on": ["draft"]})
    with CacheController(cfg, group) as ctl:
        fill(group)
        res = ctl.backup(hashes(4), range(4))
        assert res.pages == 4 and res.draft == [False] * 4 and not res.errors
        res = ctl.prefetch(hashes(4), range(4))
        assert res.pages == 4 and res.draft == [False] * 4


def test_draft_read_before_target(memory_backends) -> None:
    group = mha_group(draft=True)
    with CacheController(hc.StorageConfig(backend="memory-zc"), group) as ctl:
        fill(group)
        ctl.backup(hashes(4), range(4))
        backend = ctl.store.backend
        backend.calls.clear()
        ctl.prefetch(hashes(4), range(4))
        gets = [c for c in backend.calls if c[1] == "get"]
        assert gets[0][2] == 4 and len(gets) == 2  # the draft get (4 pages) comes first


def test_batches_are_split_by_batch_pages(memory_backends) -> None:
    group = mha_group()
    with CacheController(hc.StorageConfig(backend="memory", batch_pages=4), group) as ctl:
        fill(group)
        ctl.backup(hashes(10), range(10))
        sizes = [c[2] for c in ctl.store.backend.calls if c[1] == "set"]
        assert sizes == [4, 4, 2]


def test_async_and_prefetch_policies(memory_backends) -> None:
    group = mha_group()
    cfg = hc.StorageConfig(
        backend="memory", batch_pages=2, prefetch_policy="timeout", prefetch_timeout_s=0.05
    )
    with CacheController(cfg, group) as ctl:
        fill(group)
        hs = hashes(10)
        assert ctl.backup_async(hs, range(10)).result().pages == 10
        assert ctl.query_async(hs).result().pages == 10
        backend = ctl.store.backend
        original = backend._io

        def slow(op, keys, buffers):
            if str(op) == "get":
                time.sleep(0.03)
            return original(op, keys, buffers)

        backend._io = slow
        handle = ctl.prefetch_async(hs, range(10, 20))
        res = handle.result()
        assert 0 <= res.pages < 10  # stopped at the deadline, partial but honest
        assert all(res.per_pool[PoolName.KV][: res.pages])


def test_concurrent_operations(memory_backends) -> None:
    group = mha_group()
    with CacheController(hc.StorageConfig(backend="memory", io_threads=4), group) as ctl:
        fill(group)
        futures = [ctl.backup_async(hashes(8, seed=s), range(8)) for s in range(8)]
        assert all(f.result().pages == 8 for f in futures)
        results = []
        threads = [
            threading.Thread(target=lambda s=s: results.append(ctl.query(hashes(8, seed=s)).pages))
            for s in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [8] * 8


def test_clear_is_namespace_scoped(memory_backends) -> None:
    a, b = mha_group(), mha_group()
    with (
        CacheController(hc.StorageConfig(backend="memory", model_name="a"), a) as ca,
        CacheController(hc.StorageConfig(backend="memory", model_name="b"), b) as cb,
    ):
        fill(a), fill(b)
        ca.backup(hashes(3), range(3))
        cb.backup(hashes(3), range(3))
        assert ca.clear() == 6
        assert ca.query(hashes(3)).pages == 0 and cb.query(hashes(3)).pages == 3


def test_io_timeout_bounds_a_blocking_backend(memory_backends) -> None:
    group = mha_group()
    cfg = hc.StorageConfig(backend="memory", io_timeout_s=0.2)
    with CacheController(cfg, group) as ctl:
        fill(group)
        release = threading.Event()
        backend = ctl.store.backend
        original = backend._io

        def blocking(op, keys, buffers):
            if str(op) == "set":
                release.wait(5)
            return original(op, keys, buffers)

        backend._io = blocking
        t0 = time.monotonic()
        res = ctl.backup(hashes(3), range(3))
        assert time.monotonic() - t0 < 2
        assert res.pages == 0 and "io_timeout_s" in res.errors[0] and "'memory'" in res.errors[0]
        backend._io = original
        release.set()
        assert ctl.backup(hashes(3, seed=50), range(3)).pages == 3  # keeps serving


def test_prefetch_async_is_a_real_future(memory_backends) -> None:
    from concurrent.futures import Future, wait

    group = mha_group()
    with CacheController(hc.StorageConfig(backend="memory"), group) as ctl:
        fill(group)
        hs = hashes(4)
        ctl.backup(hs, range(4))
        handle = ctl.prefetch_async(hs, range(4, 8))
        assert isinstance(handle, Future)
        done, _ = wait([handle], timeout=10)
        assert handle in done and handle.result().pages == 4
