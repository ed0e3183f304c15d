"""TransferPath folds per-batch answers into per-plan flags in one pass: partly stored pages,
requests over several batches, stops at a miss, and progress read while a prefetch runs."""

from __future__ import annotations

import pytest
import torch

import hicache_core as hc
from hicache_core import CacheController, MHAKVPool, PoolName
from hicache_core.transfer import Plan, Request
from tests.support import membackend


def _hashes(n: int, seed: int = 0) -> list[str]:
    return hc.page_hashes(list(range(seed, seed + 4 * n)), 4)


def _controller(backend: str, batch_pages: int, **settings: object) -> CacheController:
    pool = MHAKVPool(16, 4, 2, 2, 8, allocate=False)
    cfg = hc.StorageConfig(backend=backend, model_name="fold", batch_pages=batch_pages, **settings)
    ctl = CacheController(cfg, pool)
    g = torch.Generator().manual_seed(3)
    for b in pool.buffers():
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return ctl


def _sets(ctl: CacheController) -> list[int]:
    backend = ctl.store.backend
    assert isinstance(backend, membackend.MemoryBackend)
    return [n for _path, op, n in backend.calls if op == "set"]


@pytest.mark.parametrize("settings", [{}, {"io_timeout_s": 30.0}], ids=["v2", "v1-staged"])
def test_backup_over_batches_writes_only_the_missing_pages(memory_backends, settings) -> None:
    with _controller("memory", batch_pages=4, **settings) as ctl:
        assert ctl.io_path == ("v1" if settings else "v2")
        h = _hashes(10)
        stored = [1, 5, 6, 9]
        first = ctl.backup([h[i] for i in stored], stored)
        assert first.ok and first.pages == 4
        ctl.store.backend.calls.clear()
        result = ctl.backup(h, list(range(10)))
        assert result.ok and result.pages == 10 and result.per_pool[PoolName.KV] == [True] * 10
        assert result.skipped == 4
        ncomp = 2 if ctl.io_path == "v1" else 1  # v1 counts keys, v2 pages
        assert _sets(ctl) == [3 * ncomp, 2 * ncomp, 1 * ncomp]  # batches [0,4) [4,8) [8,10)
        before = [b.clone() for b in ctl.pools.anchor.buffers()]
        for b in ctl.pools.anchor.buffers():
            b.zero_()
        read = ctl.prefetch(h, list(range(10)))
        assert read.pages == 10
        for b, ref in zip(ctl.pools.anchor.buffers(), before):
            assert torch.equal(b[:10], ref[:10])


def test_exists_stops_after_the_batch_with_a_miss_and_pads_the_rest(memory_backends) -> None:
    with _controller("memory-zc", batch_pages=4) as ctl:
        h = _hashes(10)
        ctl.backup(h, list(range(10)))
        gone = [k for k in membackend.SHARED if k.endswith(h[5])]
        assert gone
        for k in gone:
            del membackend.SHARED[k]
        req = Request(h)
        plan = Plan(PoolName.KV, ctl.pools.anchor, list(range(10)), [0] * 10)
        flags = ctl.path.exists(req, [plan])[PoolName.KV]
        assert flags == [True] * 5 + [False] + [True] * 2 + [False] * 2  # 8, 9: stored, never asked
        full = ctl.path.exists(Request(h), [plan], until_miss=False)[PoolName.KV]
        assert full == [True] * 5 + [False] + [True] * 4
        assert ctl.query(h).pages == 5


def test_get_fills_the_callers_lists_batch_by_batch(memory_backends) -> None:
    with _controller("memory-zc", batch_pages=4) as ctl:
        h = _hashes(10)
        ctl.backup(h[:6], list(range(6)))
        plan = Plan(PoolName.KV, ctl.pools.anchor, list(range(10)), list(range(10)))
        progress: dict[PoolName, list[bool]] = {PoolName.KV: []}
        seen = []

        def stopped() -> bool:
            seen.append(list(progress[PoolName.KV]))
            return False

        out = ctl.path.get(Request(h), [plan], stopped=stopped, flags=progress)
        assert out is progress
        assert seen == [[], [True] * 4]  # asked before each batch: nothing read, then one batch
        assert progress[PoolName.KV] == [True] * 6 + [False] * 4  # stopped after batch 2's miss
        result = ctl.prefetch(h, list(range(10)))
        assert result.pages == 6 and result.per_pool[PoolName.KV] == [True] * 6 + [False] * 4
