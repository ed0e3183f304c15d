"""The adapter moves pages through the core's one transfer path, with the core's rules.

Every SGLang I/O method becomes a ``Request`` and ``Plan`` s on ``hicache_core``'s
``TransferPath``: the v1 / v2 choice is ``select_io_path`` (the controller's), a set skips
stored pages with an existence pass only when the backend does not declare
``set_skips_existing``, rank-replicated pools are written by rank 0 only, and a draft failure
never touches the target pages. The store calls are recorded to check each rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_helpers import ADAPTER_LOADER, create
from sglang_pools import MambaHost, MHAHost, MLAHost, fill_random, page_bytes

from hicache_core import BackendIOError, IoOp, Layout, page_hashes
from hicache_core import PoolName as HPool
from hicache_core.transfer import select_io_path

PAGE = 4


def _idx(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def _extra(tmp_path: Path, **options: Any) -> dict[str, Any]:
    return {
        **ADAPTER_LOADER,
        "interface_v1": 1,
        "hicache_backend": "file",
        "hicache_options": {"root": str(tmp_path), **options},
    }


def _record(backend: Any, fail_pool: HPool | None = None) -> list[tuple[str, str, int]]:
    """Record every store call as ``(op, pool, entries)``; calls naming ``fail_pool`` raise."""
    store, calls = backend.store, []
    v1, v2 = store.batch_io_v1, store.batch_io_v2

    def io_v1(op: Any, keys: Any, buffers: Any = None, pool_name: Any = HPool.KV) -> list[bool]:
        calls.append((IoOp(op).value, HPool(pool_name).value, len(keys)))
        if HPool(pool_name) is fail_pool:
            raise BackendIOError("injected")
        return v1(op, keys, buffers, pool_name)

    def io_v2(op: Any, transfers: Any) -> list[list[bool]]:
        for t in transfers:
            calls.append((IoOp(op).value, t.pool.value, len(t.page_hashes)))
        if any(t.pool is fail_pool for t in transfers):
            raise BackendIOError("injected")
        return v2(op, transfers)

    store.batch_io_v1, store.batch_io_v2 = io_v1, io_v2
    return calls


@pytest.mark.parametrize("exact_skipped", [False, True])
def test_set_honours_set_skips_existing(tmp_path: Path, exact_skipped: bool) -> None:
    pool = MHAHost(16, PAGE, layer_num=2, head_num=2, head_dim=4)
    fill_random(pool, 1)
    backend = create(_extra(tmp_path, exact_skipped=exact_skipped), pool, model="m")
    try:
        caps = backend.store.capabilities
        assert caps.set_skips_existing is not exact_skipped
        assert backend.path.io_path == select_io_path(caps, Layout.PAGE_FIRST) == "v2"
        keys = page_hashes(list(range(6 * PAGE)), PAGE)
        assert backend.batch_set_v1(keys[:4], _idx([0, 1, 2, 3])) == [True] * 4
        calls = _record(backend)
        assert backend.batch_set_v1(keys, _idx([0, 1, 2, 3, 4, 5])) == [True] * 6
        if exact_skipped:  # an existence pass, then SET of the missing pages only
            assert calls == [("exists", "kv", 6), ("set", "kv", 2)]
        else:  # the store skips stored pages itself: no existence round trip
            assert calls == [("set", "kv", 6)]
        assert backend.batch_exists(keys) == 6
    finally:
        backend.close()


def test_one_store_call_per_sglang_call(tmp_path: Path) -> None:
    kv = MHAHost(12, PAGE, layer_num=2, head_num=2, head_dim=4)
    mamba = MambaHost(6, num_layers=2)
    fill_random(kv, 2)
    fill_random(mamba, 3)
    backend = create(_extra(tmp_path), kv, pools={PoolName.MAMBA: mamba}, model="m")
    try:
        keys = page_hashes(list(range(3 * PAGE)), PAGE)
        calls = _record(backend)
        res = backend.batch_set_v2(
            [
                PoolTransfer(name=PoolName.KV, host_indices=_idx([0, 1, 2]), keys=keys),
                PoolTransfer(
                    name=PoolName.MAMBA,
                    host_indices=torch.tensor([4]),
                    keys=keys[-1:],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                ),
            ]
        )
        assert res == {PoolName.KV: [True] * 3, PoolName.MAMBA: [True]}
        assert calls == [("set", "kv", 3), ("set", "mamba", 1)]  # one v2 call, two transfers
        calls.clear()
        probe = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert backend.batch_exists_v2(keys, [probe]).kv_hit_pages == 3
        assert calls == [("exists", "kv", 3), ("exists", "mamba", 3)]
    finally:
        backend.close()


def test_only_rank0_writes_rank_replicated_kv(tmp_path: Path) -> None:
    pool = MLAHost(8, PAGE, layer_num=2, kv_cache_dim=8)
    fill_random(pool, 4)
    keys = page_hashes(list(range(3 * PAGE)), PAGE)
    rank1 = create(_extra(tmp_path), pool, is_mla=True, tp_rank=1, tp_size=2, model="m")
    rank0 = create(_extra(tmp_path), pool, is_mla=True, tp_rank=0, tp_size=2, model="m")
    try:
        calls = _record(rank1)
        assert rank1.batch_set_v1(keys, _idx([0, 1, 2])) == [True] * 3  # rank 0's to write
        assert calls == [] and rank0.batch_exists(keys) == 0
        assert rank0.batch_set_v1(keys, _idx([0, 1, 2])) == [True] * 3
        assert rank1.batch_exists(keys) == 3
    finally:
        rank1.close()
        rank0.close()


def test_draft_failure_never_fails_the_target_pages(tmp_path: Path) -> None:
    kv = MHAHost(8, PAGE, layer_num=2, head_num=2, head_dim=4)
    indexer = MLAHost(8, PAGE, layer_num=2, kv_cache_dim=8)
    draft = MHAHost(8, PAGE, layer_num=1, head_num=2, head_dim=4)
    for i, p in enumerate((kv, indexer, draft)):
        fill_random(p, 10 + i)
    side = {PoolName.INDEXER: indexer, PoolName.DRAFT: draft}
    backend = create(_extra(tmp_path), kv, pools=side, model="m")
    try:
        keys = page_hashes(list(range(2 * PAGE)), PAGE)
        want = [page_bytes(indexer, p) for p in (0, 1)]

        def transfers(pages: list[int]) -> list[PoolTransfer]:
            return [PoolTransfer(name=n, host_indices=_idx(pages), keys=keys) for n in side]

        assert backend.batch_set_v2(transfers([0, 1])) == {
            PoolName.INDEXER: [True] * 2,
            PoolName.DRAFT: [True] * 2,
        }
        calls = _record(backend, fail_pool=HPool.DRAFT)
        got = backend.batch_get_v2(transfers([4, 5]))
        assert got == {PoolName.INDEXER: [True, True], PoolName.DRAFT: [False, False]}
        assert calls == [("get", "draft", 2), ("get", "indexer", 2)]  # draft first, in its own call
        assert [page_bytes(indexer, p) for p in (4, 5)] == want
    finally:
        backend.close()
