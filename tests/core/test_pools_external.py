"""``ExternalPool``: a zero-copy pool over an engine's per-layer block tensors."""

from __future__ import annotations

import pytest
import torch

from hicache_core import ArgumentTypeError, CacheController, HostPoolGroup, Layout, PoolError, StorageConfig
from hicache_core.pools import ExternalPool, block_geometry

L, B, H, N, C = 3, 6, 2, 4, 8  # layers, blocks, heads, tokens per block, content


def _lbhnc() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vLLM's CPU layout: one allocation, layer-major, per-layer [B, H, N, C] views."""
    buf = torch.randn(L, B, H, N, C).to(torch.bfloat16)
    return buf, [buf[layer] for layer in range(L)]


def test_layer_major_blocks_view_the_engine_memory_in_place() -> None:
    buf, layers = _lbhnc()
    pool = ExternalPool.from_block_tensors(layers, page_size=N)
    assert pool.layout is Layout.LAYER_FIRST and pool.num_pages == B and pool.components == ("kv",)
    assert pool.page_nbytes == L * H * N * C * 2
    page = pool.page_views([4])[0][0]
    assert torch.equal(
        page.reshape(-1), torch.cat([layers[i][4].reshape(-1).view(torch.uint8) for i in range(L)])
    )
    page.zero_()  # writes land in the engine's tensor
    assert not buf[:, 4].any() and buf[:, 3].any()
    with pytest.raises(PoolError):
        pool.allocate()


def test_block_outermost_layout_is_page_first_and_contiguous() -> None:
    buf = torch.randn(B, L, H, N, C)
    pool = ExternalPool.from_block_tensors([buf[:, layer] for layer in range(L)], page_size=N)
    assert pool.layout is Layout.PAGE_FIRST
    ((ptr, size),) = pool.page_meta([2])[0]
    assert ptr == buf[2].data_ptr() and size == buf[2].numel() * 4


def test_heads_outside_blocks_become_runs() -> None:
    buf = torch.randn(L, H, B, N, C)
    pool = ExternalPool.from_block_tensors([buf[layer].transpose(0, 1) for layer in range(L)], page_size=N)
    assert pool.geometry.runs == L * H
    assert torch.equal(pool.page_views([5])[0][0].reshape(-1), buf[:, :, 5].reshape(-1).view(torch.uint8))


def test_permuted_dense_block_is_one_run() -> None:
    """vLLM's LBNHC layout (tokens before heads in memory) viewed as [B, H, N, C] per layer."""
    buf = torch.randn(L, B, N, H, C)
    pool = ExternalPool.from_block_tensors([buf[layer].transpose(1, 2) for layer in range(L)], page_size=N)
    assert pool.geometry.runs == L and pool.geometry.run_nbytes == N * H * C * 4
    assert torch.equal(pool.page_views([3])[0][0].reshape(-1), buf[:, 3].reshape(-1).view(torch.uint8))


def test_strided_runs_inside_a_block() -> None:
    buf = torch.arange(32, dtype=torch.float32).view(4, 8)
    pool = ExternalPool.from_block_tensors([buf[:, ::2]], page_size=1)
    assert pool.geometry.runs == 4 and pool.geometry.run_nbytes == 4
    assert pool.page_views([1])[0][0].reshape(-1).view(torch.float32).tolist() == [8.0, 10.0, 12.0, 14.0]


def test_shared_layers_count_once() -> None:
    _, layers = _lbhnc()
    assert block_geometry([*layers, layers[0]]).runs == L


@pytest.mark.parametrize(
    "tensors, error",
    [
        ([], ArgumentTypeError),
        (["x"], ArgumentTypeError),
        ([torch.zeros(4, 8), torch.zeros(4, 8)], PoolError),  # two allocations
        ([torch.zeros(16).as_strided((4, 8), (2, 1))], PoolError),  # blocks overlap
        ([torch.zeros(4)], PoolError),  # no block dimension
    ],
)
def test_geometries_it_cannot_view_are_refused(tensors: list[object], error: type[Exception]) -> None:
    with pytest.raises(error):
        ExternalPool.from_block_tensors(tensors, page_size=4)  # type: ignore[arg-type]


def test_layers_not_equally_spaced_are_refused() -> None:
    buf = torch.zeros(4, B, 8)
    with pytest.raises(PoolError, match="equally spaced"):
        ExternalPool.from_block_tensors([buf[0], buf[1], buf[3]], page_size=4)


def test_round_trip_through_the_controller(tmp_path: object) -> None:
    buf, layers = _lbhnc()
    pool = ExternalPool.from_block_tensors(layers, page_size=N)
    config = StorageConfig(backend="file", options={"root": str(tmp_path)}, layout="layer_first")
    want = buf.clone()
    hashes = [f"{i:064x}" for i in range(1, B + 1)]
    with CacheController(config, HostPoolGroup(pool)) as ctl:
        assert ctl.backup(hashes, list(range(B))).pages == B
        buf.zero_()
        assert ctl.prefetch(hashes, list(range(B))).pages == B
    assert torch.equal(buf, want)
