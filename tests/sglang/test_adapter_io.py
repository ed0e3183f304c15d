"""The adapter through SGLang's real code on the file backend and on Mooncake (real master).

Every test runs on the file backend; the cases marked ``BOTH`` (MHA and MLA over v1, KV+Mamba
and MLA+indexer over v2) also run on Mooncake. Pools are SGLang host pools whose storage-path
methods are SGLang's own (see ``sglang_pools``); every byte is verified.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_pools import MambaHost, MHAHost, MLAHost, fill_random, page_bytes

from hicache_core import page_hashes

PAGE = 4
BOTH = pytest.mark.parametrize(
    "backend_spec", ["file", pytest.param("mooncake", marks=pytest.mark.mooncake)], indirect=True
)


def hashes(n: int, seed: int = 0, page_size: int = PAGE) -> list[str]:
    """Chained page hashes, byte-identical to SGLang's ``get_hash_str`` (see test_readme_and_config)."""
    tokens = [(seed * 7919 + i * 31) % 50000 for i in range(n * page_size)]
    out = page_hashes(tokens, page_size)
    assert isinstance(out, list) and len(out) == n
    return out


def token_indices(pages: list[int], page_size: int = PAGE) -> torch.Tensor:
    """SGLang host indices: the token indices of each page, ``len(pages) * page_size`` of them."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(torch.int64)


def snapshot(pool: Any, pages: list[int]) -> list[bytes]:
    return [page_bytes(pool, p) for p in pages]


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_mha_v1_roundtrip_every_byte(make_adapter: Any, layout: str) -> None:
    _mha_v1_roundtrip(make_adapter, layout)


@BOTH
def test_mha_v1_page_first(make_adapter: Any) -> None:
    _mha_v1_roundtrip(make_adapter, "page_first")


def _mha_v1_roundtrip(make_adapter: Any, layout: str) -> None:
    pool = MHAHost(24, PAGE, layer_num=3, head_num=2, head_dim=8, layout=layout)
    fill_random(pool, 1)
    backend = make_adapter(pool)
    keys = hashes(8)
    src = [3, 1, 4, 9, 5, 2, 6, 0]
    want = snapshot(pool, src)

    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:5], token_indices(src[:5])) == [True] * 5
    assert backend.batch_exists(keys) == 5
    assert backend.batch_set_v1(keys, token_indices(src)) == [True] * 8  # stored ones are skipped
    assert backend.batch_exists(keys) == 8

    dst = list(range(12, 20))
    got = backend.batch_get_v1(keys, token_indices(dst))
    assert got == [True] * 8
    assert snapshot(pool, dst) == want

    missing = hashes(2, seed=99)
    assert backend.batch_get_v1([keys[0], missing[0], keys[2]], token_indices([20, 21, 22])) == [
        True,
        False,
        True,
    ]
    assert backend.batch_exists([*keys[:3], missing[1], keys[4]]) == 3


@BOTH
def test_mla_v1_roundtrip_and_rank_replication(make_adapter: Any) -> None:
    pool = MLAHost(20, PAGE, layer_num=4, kv_cache_dim=24, layout="page_first")
    fill_random(pool, 2)
    rank0 = make_adapter(pool, is_mla=True, tp_rank=0, tp_size=2)
    keys = hashes(6, seed=1)
    src = [5, 0, 7, 2, 9, 1]
    want = snapshot(pool, src)
    assert rank0.batch_set_v1(keys, token_indices(src)) == [True] * 6

    # MLA KV is rank-replicated: rank 1 (its own pool and adapter) hits and reads rank 0's pages.
    other = MLAHost(20, PAGE, layer_num=4, kv_cache_dim=24, layout="page_first")
    rank1 = make_adapter(other, is_mla=True, tp_rank=1, tp_size=2)
    assert rank1.batch_exists(keys) == 6
    assert rank1.batch_get_v1(keys, token_indices(list(range(10, 16)))) == [True] * 6
    assert snapshot(other, list(range(10, 16))) == want


def test_mha_keys_are_per_rank(make_adapter: Any) -> None:
    pool = MHAHost(12, PAGE, layer_num=2, head_num=2, head_dim=4)
    fill_random(pool, 3)
    rank0 = make_adapter(pool, tp_rank=0, tp_size=2)
    keys = hashes(3, seed=2)
    assert rank0.batch_set_v1(keys, token_indices([0, 1, 2])) == [True] * 3
    rank1 = make_adapter(MHAHost(12, PAGE, layer_num=2, head_num=2, head_dim=4), tp_rank=1, tp_size=2)
    assert rank1.batch_exists(keys) == 0  # MHA heads differ per TP rank: never shared


@BOTH
def test_kv_and_mamba_v2_roundtrip(make_adapter: Any) -> None:
    kv = MHAHost(16, PAGE, layer_num=2, head_num=2, head_dim=8, layout="page_first")
    mamba = MambaHost(8, num_layers=3)
    fill_random(kv, 4)
    fill_random(mamba, 5)
    backend = make_adapter(kv, pools={PoolName.MAMBA: mamba})
    keys = hashes(5, seed=3)
    kv_src, mamba_slot_mid, mamba_slot_end = [2, 7, 1, 3, 0], 6, 2
    want_kv = snapshot(kv, kv_src)
    want_mamba = snapshot(mamba, [mamba_slot_mid, mamba_slot_end])

    res = backend.batch_set_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=token_indices(kv_src), keys=keys),
            PoolTransfer(
                name=PoolName.MAMBA,
                host_indices=torch.tensor([mamba_slot_end]),
                keys=[keys[-1]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]
    )
    assert res == {PoolName.KV: [True] * 5, PoolName.MAMBA: [True]}
    # Mamba state also for the prefix that ends at page 2 (a second legal stop point).
    res = backend.batch_set_v2(
        [
            PoolTransfer(
                name=PoolName.MAMBA,
                host_indices=torch.tensor([mamba_slot_mid]),
                keys=[keys[1]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
        ]
    )
    assert res == {PoolName.MAMBA: [True]}

    trailing = PoolTransfer(name=PoolName.MAMBA, keys=[keys[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = backend.batch_exists_v2(keys, [trailing])
    assert hit.kv_hit_pages == 5
    assert hit.restorable_prefix_pages == [2, 5]
    assert hit.extra_pool_hit_pages == {PoolName.KV: 5, PoolName.MAMBA: 5}
    # A two-page trailing window needs the state of two consecutive pages: no stop point has it.
    window2 = PoolTransfer(name=PoolName.MAMBA, keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert backend.batch_exists_v2(keys, [window2]).kv_hit_pages == 0

    got = backend.batch_get_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=token_indices([8, 9, 10, 11, 12]), keys=keys),
            PoolTransfer(
                name=PoolName.MAMBA,
                host_indices=torch.tensor([4, 5]),
                keys=[keys[1], keys[-1]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]
    )
    assert got == {PoolName.KV: [True] * 5, PoolName.MAMBA: [True, True]}
    assert snapshot(kv, [8, 9, 10, 11, 12]) == want_kv
    assert snapshot(mamba, [4, 5]) == want_mamba


@BOTH
def test_mla_with_indexer_all_pages(make_adapter: Any) -> None:
    kv = MLAHost(12, PAGE, layer_num=2, kv_cache_dim=16)
    indexer = MLAHost(12, PAGE, layer_num=2, kv_cache_dim=8)
    fill_random(kv, 6)
    fill_random(indexer, 7)
    backend = make_adapter(kv, pools={PoolName.INDEXER: indexer}, is_mla=True)
    keys = hashes(4, seed=4)
    backend.batch_set_v1(keys, token_indices([0, 1, 2, 3]))
    res = backend.batch_set_v2(
        [PoolTransfer(name=PoolName.INDEXER, host_indices=token_indices([0, 1]), keys=keys[:2])]
    )
    assert res == {PoolName.INDEXER: [True, True]}
    need = PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    hit = backend.batch_exists_v2(keys, [need])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (2, [1, 2])
    assert hit.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.INDEXER: 2}


def test_legacy_generic_page_path(make_adapter: Any) -> None:
    """SGLang's generic path (no ``interface_v1``): flat data pages through batch_set / batch_get."""
    pool = MHAHost(10, PAGE, layer_num=2, head_num=2, head_dim=8)
    fill_random(pool, 8)
    backend = make_adapter(pool)
    keys = hashes(3, seed=5)
    assert backend.batch_set(keys, [pool.get_data_page(p * PAGE) for p in (4, 2, 7)]) is True
    assert backend.exists(keys[1]) and not backend.exists(hashes(1, seed=77)[0])
    dummies = [pool.get_dummy_flat_data_page() for _ in range(4)]
    got = backend.batch_get([*keys, hashes(1, seed=78)[0]], dummies)
    assert got[3] is None and all(g is not None for g in got[:3])
    for g, p in zip(got[:3], (4, 2, 7)):
        assert g.view(torch.uint8).numpy().tobytes() == page_bytes(pool, p)
    # ... and the same objects are visible to the zero-copy v1 path.
    assert backend.batch_get_v1(keys, token_indices([0, 1, 3])) == [True] * 3
    assert snapshot(pool, [0, 1, 3]) == snapshot(pool, [4, 2, 7])


def test_draft_pool_v2(make_adapter: Any) -> None:
    kv = MHAHost(8, PAGE, layer_num=2, head_num=2, head_dim=4)
    draft = MHAHost(8, PAGE, layer_num=1, head_num=2, head_dim=4)
    fill_random(kv, 9)
    fill_random(draft, 10)
    backend = make_adapter(kv, pools={PoolName.DRAFT: draft})
    keys = hashes(2, seed=6)
    want = snapshot(draft, [0, 1])
    tr = PoolTransfer(name=PoolName.DRAFT, host_indices=token_indices([0, 1]), keys=keys)
    assert backend.batch_set_v2([tr]) == {PoolName.DRAFT: [True, True]}
    assert backend.batch_exists(keys) == 0  # draft keys live apart from the target KV
    back = PoolTransfer(name=PoolName.DRAFT, host_indices=token_indices([5, 6]), keys=keys)
    assert backend.batch_get_v2([back]) == {PoolName.DRAFT: [True, True]}
    assert snapshot(draft, [5, 6]) == want


def test_clear_is_namespace_scoped(make_adapter: Any) -> None:
    pool = MHAHost(8, PAGE, layer_num=2, head_num=2, head_dim=4)
    fill_random(pool, 11)
    mine = make_adapter(pool)
    theirs = make_adapter(MHAHost(8, PAGE, layer_num=2, head_num=2, head_dim=4), model="another/model")
    keys = hashes(3, seed=7)
    assert all(mine.batch_set_v1(keys, token_indices([0, 1, 2])))
    assert all(theirs.batch_set_v1(keys, token_indices([0, 1, 2])))
    assert mine.clear() is True
    assert mine.batch_exists(keys) == 0
    assert theirs.batch_exists(keys) == 3


def test_concurrent_backup_and_prefetch_threads(make_adapter: Any) -> None:
    """SGLang calls the backend from its backup, prefetch and I/O threads at the same time."""
    from concurrent.futures import ThreadPoolExecutor

    pool = MHAHost(64, PAGE, layer_num=2, head_num=2, head_dim=8)
    fill_random(pool, 12)
    backend = make_adapter(pool)
    groups = [(hashes(4, seed=50 + g), list(range(4 * g, 4 * g + 4))) for g in range(8)]
    want = {g: snapshot(pool, src) for g, (_, src) in enumerate(groups)}

    def roundtrip(g: int) -> bool:
        keys, src = groups[g]
        dst = [32 + p for p in src]
        ok = all(backend.batch_set_v1(keys, token_indices(src)))
        ok &= backend.batch_exists(keys) == 4
        ok &= all(backend.batch_get_v1(keys, token_indices(dst)))
        return ok and snapshot(pool, dst) == want[g]

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(roundtrip, range(8)))
