"""Design §6 sizing helpers: the standalone shared-mapping size and Mamba slots on a PD decode node."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from hicache_core import (
    ConfigError,
    HiCacheError,
    HostPoolGroup,
    MambaPool,
    MHAKVPool,
    MLAKVPool,
    PoolError,
    PoolName,
    StorageConfig,
    load_config,
)
from hicache_core.sizing import decode_mamba_pool_size, standalone_required_bytes

U8 = torch.uint8


# ------------------------------------------------------------- standalone mapping size
def fake_kv() -> SimpleNamespace:
    return SimpleNamespace(kv_buffer=torch.zeros(128, dtype=U8))


def fake_mamba() -> SimpleNamespace:
    # 16 float32 = 64 bytes of temporal state, one 32-byte conv buffer
    return SimpleNamespace(temporal=torch.zeros(16, dtype=torch.float32), conv=[torch.zeros(32, dtype=U8)])


def real_pools() -> tuple[MLAKVPool, MambaPool]:
    kv = MLAKVPool(1, 1, 1, 128, dtype=U8)  # one page, one layer, 128 one-byte elements
    mamba = MambaPool(1, 1, (16,), [(32,)], temporal_dtype=torch.float32, conv_dtype=U8)
    return kv, mamba


def test_224_bytes_with_small_fake_pools() -> None:
    assert standalone_required_bytes({"kv": fake_kv(), "mamba": fake_mamba()}) == 224


def test_224_bytes_with_fake_pools_exposing_get_hybrid_pool_buffer() -> None:
    mamba = fake_mamba()
    getter = SimpleNamespace(get_hybrid_pool_buffer=lambda: [mamba.temporal, mamba.conv])
    assert standalone_required_bytes({"kv": fake_kv(), "mamba": getter}) == 224


def test_224_bytes_with_real_hicache_pools() -> None:
    kv, mamba = real_pools()
    assert [b.numel() * b.element_size() for b in (*kv.buffers(), *mamba.buffers())] == [128, 64, 32]
    assert standalone_required_bytes(HostPoolGroup(kv, {PoolName.MAMBA: mamba})) == 224
    assert standalone_required_bytes({PoolName.KV: kv, PoolName.MAMBA: mamba}) == 224
    mha = MHAKVPool(1, 1, 1, 1, 64, dtype=U8)  # K and V of 64 bytes each: the same 128-byte anchor
    assert standalone_required_bytes({"kv": mha, "mamba": mamba}) == 224


def test_buffers_are_deduplicated_by_data_ptr() -> None:
    kv, mamba = real_pools()
    # a draft pool that aliases the target KV buffer adds nothing
    alias = SimpleNamespace(kv_buffer=kv.buffers()[0])
    assert standalone_required_bytes({"kv": kv, "mamba": mamba, "draft": alias}) == 224
    fk, fm = fake_kv(), fake_mamba()
    assert standalone_required_bytes({"kv": fk, "mamba": fm, "draft": fk}) == 224


def test_a_single_pool_and_planned_pools() -> None:
    kv, _ = real_pools()
    assert standalone_required_bytes(kv) == 128
    planned = MLAKVPool(1, 1, 1, 128, dtype=U8, allocate=False)
    assert standalone_required_bytes({"kv": planned}) == planned.nbytes == 128


def test_missing_pool_is_a_pool_error_not_attribute_error() -> None:
    with pytest.raises(PoolError, match="'mamba' is missing") as err:
        standalone_required_bytes({"kv": fake_kv(), "mamba": None})
    assert not isinstance(err.value, AttributeError)
    with pytest.raises(PoolError, match="KV anchor"):
        standalone_required_bytes({"mamba": fake_mamba()})
    with pytest.raises(PoolError, match="exposes no buffers"):
        standalone_required_bytes({"kv": fake_kv(), "indexer": object()})


def test_group_without_the_pool_is_a_pool_error() -> None:
    kv, _ = real_pools()
    group = HostPoolGroup(kv)
    with pytest.raises(PoolError, match="not in this HostPoolGroup"):
        standalone_required_bytes({"kv": kv, "mamba": group[PoolName.MAMBA]})


# ------------------------------------------------------------- PD decode Mamba slots
@pytest.mark.parametrize(
    ("args", "kwargs", "expected", "warns"),
    [
        ((8, 2, 10), {"extra_buffer": True, "overlap_schedule": True}, 30, True),
        ((8, 2, 40), {"extra_buffer": True, "overlap_schedule": False}, 40, False),
        ((8, 2, None), {"extra_buffer": False, "overlap_schedule": True}, 10, False),
        ((8, 2, 10), {"extra_buffer": True, "overlap_schedule": False}, 20, True),  # ping_pong 1
        ((8, 2, 10), {"extra_buffer": False, "overlap_schedule": False}, 10, False),  # equal: no raise
        ((0, 0, 0), {"extra_buffer": True, "overlap_schedule": True}, 0, False),
    ],
)
def test_decode_mamba_pool_size_worked_numbers(
    caplog: pytest.LogCaptureFixture,
    args: tuple[int, int, int | None],
    kwargs: dict[str, bool],
    expected: int,
    warns: bool,
) -> None:
    with caplog.at_level(logging.WARNING, logger="hicache"):
        assert decode_mamba_pool_size(*args, **kwargs) == expected
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    if warns:
        assert len(warnings) == 1
        assert str(args[2]) in warnings[0].getMessage() and str(expected) in warnings[0].getMessage()
    else:
        assert warnings == []


def test_decode_mamba_pool_size_keywords_are_required() -> None:
    with pytest.raises(TypeError):
        decode_mamba_pool_size(8, 2, 10, True, True)  # type: ignore[misc]


@pytest.mark.parametrize(
    "args",
    [(-1, 2, 10), (8, -2, 10), (8, 2, -10), (8.5, 2, 10), (8, 2, True), ("8", 2, None)],
)
def test_decode_mamba_pool_size_rejects_invalid_inputs(args: tuple[object, object, object]) -> None:
    with pytest.raises(ConfigError) as err:
        decode_mamba_pool_size(*args, extra_buffer=True, overlap_schedule=True)  # type: ignore[arg-type]
    assert isinstance(err.value, HiCacheError) and isinstance(err.value, ValueError)
    assert "non-negative int" in str(err.value)


def test_decode_config_forces_no_buffer_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hicache"):
        cfg = StorageConfig(disaggregation_mode="decode", mamba_scheduler_strategy="extra_buffer")
    assert cfg.mamba_scheduler_strategy == "no_buffer"
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "extra_buffer" in msgs[0] and "no_buffer" in msgs[0] and "decode" in msgs[0]


def test_decode_normalisation_applies_to_every_config_source(caplog: pytest.LogCaptureFixture) -> None:
    env = {"HICACHE_DISAGGREGATION_MODE": "decode", "HICACHE_MAMBA_SCHEDULER_STRATEGY": "extra_buffer"}
    with caplog.at_level(logging.WARNING, logger="hicache"):
        assert load_config(environ=env).mamba_scheduler_strategy == "no_buffer"
        assert StorageConfig.from_env(env).mamba_scheduler_strategy == "no_buffer"
    assert sum("no_buffer" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize("mode", ["null", "prefill"])
def test_non_decode_configs_keep_extra_buffer(caplog: pytest.LogCaptureFixture, mode: str) -> None:
    with caplog.at_level(logging.WARNING, logger="hicache"):
        cfg = StorageConfig(disaggregation_mode=mode, mamba_scheduler_strategy="extra_buffer")
    assert cfg.mamba_scheduler_strategy == "extra_buffer"
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    plain = StorageConfig(disaggregation_mode="decode")
    assert plain.mamba_scheduler_strategy == "no_buffer"


def test_invalid_mode_or_strategy_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        load_config(environ={"HICACHE_MAMBA_SCHEDULER_STRATEGY": "double_buffer"})
    with pytest.raises(ConfigError):
        load_config(environ={"HICACHE_DISAGGREGATION_MODE": "encode"})


# ------------------------------------------------------------- the pool sizes itself (proposed API)
def _for_node() -> object:
    fn = getattr(MambaPool, "for_node", None)
    if fn is None:
        pytest.skip(
            "MambaPool.for_node (decode-node self-sizing, proposed in the issue-5 report) is not in the core yet"
        )
    return fn


def test_mamba_pool_sizes_itself_on_a_decode_node(caplog: pytest.LogCaptureFixture) -> None:
    for_node = _for_node()
    decode = StorageConfig(disaggregation_mode="decode")
    kw = {"max_running_requests": 8, "pre_alloc_size": 2, "extra_buffer": True, "overlap_schedule": True}
    with caplog.at_level(logging.WARNING, logger="hicache"):
        pool = for_node(decode, 1, (4,), [(2,)], num_slots=10, **kw)  # type: ignore[operator]
    assert pool.num_pages == 30 and len(caplog.records) == 1
    caplog.clear()
    big = for_node(decode, 1, (4,), [(2,)], num_slots=40, **kw)  # type: ignore[operator]
    assert big.num_pages == 40 and not caplog.records
    plain = for_node(StorageConfig(), 1, (4,), [(2,)], num_slots=10, **kw)  # type: ignore[operator]
    assert plain.num_pages == 10  # prefill / non-PD nodes keep their size
    with pytest.raises(PoolError):
        for_node(StorageConfig(), 1, (4,), [(2,)], num_slots=None, **kw)  # type: ignore[operator]
