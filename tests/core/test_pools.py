"""Host pools: geometry, views, zero-copy metadata, group allocation, sizing."""

from __future__ import annotations

import types

import pytest
import torch

import hicache_core as hc
from hicache_core import HostPoolGroup, MambaPool, MHAKVPool, MLAKVPool, PoolName
from hicache_core.sizing import standalone_required_bytes


def test_mha_page_first_views_are_contiguous_and_match_typed() -> None:
    pool = MHAKVPool(num_pages=4, page_size=2, num_layers=3, num_heads=2, head_dim=4, dtype=torch.float16)
    assert pool.components == ("k", "v")
    assert pool.component_nbytes == (3 * 2 * 2 * 4 * 2,) * 2
    k = pool.typed("k")
    assert k.shape == (4, 3, 2, 2, 4) and k.dtype == torch.float16
    k[2].fill_(1.5)
    view = pool.page_views([2])[0][0]
    assert view.is_contiguous() and view.numel() == pool.component_nbytes[0]
    assert torch.equal(view.view(torch.float16), torch.full((48,), 1.5, dtype=torch.float16))
    (ptr, size), _ = pool.page_meta([2])[0]
    assert ptr == view.data_ptr() and size == view.numel()


def test_layer_first_views_have_same_byte_order() -> None:
    a = MHAKVPool(4, 2, 3, 2, 4, layout="page_first")
    b = MHAKVPool(4, 2, 3, 2, 4, layout="layer_first")
    a.buffers()[0].copy_(torch.randint(0, 255, a.buffers()[0].shape, dtype=torch.uint8))
    b.page_views([1])[0][0].copy_(a.page_views([1])[0][0].view(3, -1))
    assert torch.equal(b.buffers()[0][:, 1], a.buffers()[0][1])  # bytes (random bits may be NaN)
    assert b.typed("k")[:, 1].shape == a.typed("k")[1].shape
    with pytest.raises(hc.PoolError, match="page_first"):
        b.page_meta([0])


def test_bad_indices_and_components() -> None:
    pool = MLAKVPool(4, 2, 1, 8)
    with pytest.raises(hc.BatchShapeError, match="out of range"):
        pool.page_views([4])
    with pytest.raises(hc.BatchShapeError):
        pool.page_views([-1])
    with pytest.raises(hc.PoolError, match="no component"):
        pool.buffer("k")
    with pytest.raises(hc.PoolError):
        MHAKVPool(0, 2, 1, 1, 1)


def test_planned_pools_allocate_from_one_region() -> None:
    kv = MHAKVPool(8, 4, 2, 2, 8, allocate=False)
    mamba = MambaPool(4, 2, (3, 5), [(2, 7), (4,)], allocate=False)
    group = HostPoolGroup(kv, {PoolName.MAMBA: mamba})
    with pytest.raises(hc.PoolError, match="not allocated"):
        kv.buffers()
    regions = []

    def alloc(n: int) -> torch.Tensor:
        regions.append(torch.zeros(n, dtype=torch.uint8))
        return regions[-1]

    need = standalone_required_bytes(group)
    group.allocate(alloc)
    assert len(regions) == 1 and regions[0].numel() == need == kv.nbytes + mamba.nbytes
    base = regions[0].data_ptr()
    for b in (*kv.buffers(), *mamba.buffers()):
        assert base <= b.data_ptr() < base + need and b.data_ptr() % 64 == 0
    assert mamba.components == ("temporal", "conv_0", "conv_1")
    assert mamba.hit_policy is hc.HitPolicy.TRAILING_PAGES


def test_group_errors() -> None:
    kv = MHAKVPool(2, 1, 1, 1, 1)
    with pytest.raises(hc.PoolError):
        HostPoolGroup(None)  # type: ignore[arg-type]
    with pytest.raises(hc.PoolError, match="unknown pool"):
        HostPoolGroup(kv, {"weights": kv})
    with pytest.raises(hc.PoolError, match="not in this HostPoolGroup"):
        HostPoolGroup(kv)[PoolName.MAMBA]


def test_standalone_size_example_from_design() -> None:
    def buf(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8)

    kv = types.SimpleNamespace(buffers=lambda: [buf(128)])
    shared = buf(64)
    mamba = types.SimpleNamespace(buffers=lambda: [shared, buf(32)])
    assert standalone_required_bytes({"kv": kv, "mamba": mamba}) == 224
    # the same buffer seen twice (dedup by data_ptr) counts once
    assert (
        standalone_required_bytes(
            {"kv": kv, "mamba": mamba, "draft": types.SimpleNamespace(buffers=lambda: [shared])}
        )
        == 224
    )
    # SGLang-style pools (kv_buffer / get_hybrid_pool_buffer) work too
    sg_kv = types.SimpleNamespace(kv_buffer=buf(128))
    sg_mamba = types.SimpleNamespace(get_hybrid_pool_buffer=lambda: [buf(64), [buf(32)]])
    assert standalone_required_bytes({"kv": sg_kv, "mamba": sg_mamba}) == 224


def test_standalone_size_missing_pool_is_clear() -> None:
    with pytest.raises(hc.PoolError, match="'mamba' is missing"):
        standalone_required_bytes({"kv": MHAKVPool(2, 1, 1, 1, 1), "mamba": None})
    with pytest.raises(hc.PoolError, match="KV anchor"):
        standalone_required_bytes({"mamba": MHAKVPool(2, 1, 1, 1, 1)})
    with pytest.raises(hc.PoolError, match="exposes no buffers"):
        standalone_required_bytes({"kv": object()})
