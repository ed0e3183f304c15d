"""Bad settings fail early with a typed error naming them; the weights revision separates keys.

Written against public names only, so the same file runs on older checkouts (each test here
failed before the checks it covers existed).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hicache_core as hc
from hicache_core import (
    CacheController,
    ComponentSpec,
    ConfigError,
    HiCacheError,
    HostPoolGroup,
    IndexerPool,
    KeyScheme,
    MambaPool,
    MHAKVPool,
    MLAKVPool,
    StorageConfig,
    load_config,
)


def _hashes(n: int) -> list[str]:
    return [hashlib.sha256(f"page {i}".encode()).hexdigest() for i in range(n)]


def _controller(tmp_path: Path, **cfg: object) -> CacheController:
    config = StorageConfig(backend="file", options={"root": str(tmp_path / "store")}, **cfg)
    return CacheController(config, HostPoolGroup(MHAKVPool(8, 4, 1, 1, 8)))


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[CacheController]:
    ctl = _controller(tmp_path)
    yield ctl
    ctl.close()


# ----------------------------------------------------------------------- infinite timeouts
@pytest.mark.parametrize("field", ["io_timeout_s", "prefetch_timeout_s"])
@pytest.mark.parametrize("value", [math.inf, "inf", "Infinity", -math.inf, math.nan, "nan", 1e300])
def test_infinite_timeout_is_a_config_error_at_config_time(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        StorageConfig(**{field: value})
    with pytest.raises(ConfigError, match=field):
        load_config(environ={}, controller={field: value})


@pytest.mark.parametrize("field", ["io_timeout_s", "prefetch_timeout_s"])
def test_infinite_timeout_from_env_and_file_is_a_config_error(tmp_path: Path, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(environ={"HICACHE_" + field.upper(): "inf"})
    path = tmp_path / "c.yaml"
    path.write_text(f"{field}: .inf\n")  # YAML's infinity
    with pytest.raises(ConfigError, match=field):
        load_config(path, environ={})
    ok = load_config(environ={"HICACHE_" + field.upper(): "2.5"})
    assert ok.controller.model_dump()[field] == 2.5


# ------------------------------------------------------------ typed errors, named arguments
def test_host_pool_group_extras_not_a_mapping_names_the_argument() -> None:
    kv = MHAKVPool(2, 1, 1, 1, 1)
    for bad in (object(), [kv], "mamba", 3):
        with pytest.raises(HiCacheError, match="extras") as info:
            HostPoolGroup(kv, bad)  # type: ignore[arg-type]
        assert isinstance(info.value, TypeError)


def test_backup_extra_not_a_mapping_names_the_argument(controller: CacheController) -> None:
    hs = _hashes(2)
    for call in (controller.backup, controller.prefetch, controller.backup_async, controller.prefetch_async):
        with pytest.raises(HiCacheError, match="extra") as info:
            call(hs, [0, 1], extra=[1])
        assert isinstance(info.value, TypeError)
    assert controller.backup(hs, [0, 1]).pages == 2  # the controller still works


@pytest.mark.parametrize("name", ["bfloat16", "torch.bfloat16", "bf16", " bfloat16 "])
def test_dtype_names_are_accepted(name: str) -> None:
    assert MHAKVPool(2, 1, 1, 1, 4, dtype=name).dtype is torch.bfloat16  # type: ignore[arg-type]
    assert MHAKVPool(2, 1, 1, 1, 4, dtype="float16").typed("k").dtype is torch.float16  # type: ignore[arg-type]
    assert MLAKVPool(2, 1, 1, 4, dtype="float32").dtype is torch.float32  # type: ignore[arg-type]
    assert ComponentSpec("k", 1, (2,), "uint8").dtype is torch.uint8  # type: ignore[arg-type]
    mamba = MambaPool(2, 1, (2,), [(3,)], temporal_dtype="float32", conv_dtype="bf16")  # type: ignore[arg-type]
    assert mamba.typed("conv_0").dtype is torch.bfloat16
    assert IndexerPool(2, 1, 1, 4, dtype="uint8").typed("indexer").dtype is torch.uint8  # type: ignore[arg-type]


def test_bad_dtype_names_the_argument() -> None:
    with pytest.raises(HiCacheError, match="dtype") as info:
        MHAKVPool(2, 1, 1, 1, 4, dtype="bfloat17")  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError) and "bfloat17" in str(info.value)
    for bad in (3, None, object(), torch.zeros(1)):
        with pytest.raises(HiCacheError, match="dtype") as info:
            MHAKVPool(2, 1, 1, 1, 4, dtype=bad)  # type: ignore[arg-type]
        assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_pages": "4"}, "num_pages"),
        ({"num_pages": 2.0}, "num_pages"),
        ({"num_pages": True}, "num_pages"),
        ({"num_pages": 0}, "num_pages"),
        ({"page_size": None}, "page_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"num_heads": [2]}, "num_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"layout": "diagonal"}, "layout"),
        ({"layout": 5}, "layout"),
        ({"allocator": 5}, "allocator"),
    ],
)
def test_pool_constructor_errors_name_the_argument(kwargs: dict[str, object], name: str) -> None:
    args: dict[str, object] = {"num_pages": 2, "page_size": 1, "num_layers": 1, "num_heads": 1, "head_dim": 4}
    with pytest.raises(HiCacheError, match=name) as info:
        MHAKVPool(**{**args, **kwargs})  # type: ignore[arg-type]
    assert isinstance(info.value, (TypeError, ValueError))


def test_mamba_pool_shapes_are_checked() -> None:
    with pytest.raises(HiCacheError, match="temporal_shape"):
        MambaPool(2, 1, "44", [(3,)])  # type: ignore[arg-type]
    with pytest.raises(HiCacheError, match="conv_shapes"):
        MambaPool(2, 1, (2,), 3)  # type: ignore[arg-type]
    with pytest.raises(HiCacheError, match=r"conv_shapes\[0\]"):
        MambaPool(2, 1, (2,), [(3, -1)])


def test_pool_too_large_to_allocate_is_a_pool_error() -> None:
    with pytest.raises(hc.PoolError, match="allocate"):
        MHAKVPool(1 << 40, 1 << 10, 1 << 10, 1, 1)
    assert MHAKVPool(1 << 40, 1 << 10, 1 << 10, 1, 1, allocate=False).nbytes > 1 << 60


def test_host_indices_that_are_not_page_indices_are_refused(controller: CacheController) -> None:
    hs = _hashes(2)
    for bad in ([0.0, 1.0], [True, False], torch.tensor([True, False]), b"\x00\x01", {0, 1}, "01"):
        with pytest.raises(hc.BatchShapeError):
            controller.backup(hs, bad)
    for bad_hashes in (set(hs), {h: 0 for h in hs}):
        with pytest.raises(hc.BatchShapeError, match="ordered"):
            controller.backup(bad_hashes, [0, 1])  # type: ignore[arg-type]


def test_value_types_raise_typed_errors() -> None:
    with pytest.raises(hc.BackendContractError, match="pools") as info:
        hc.Capabilities(pools=["kv", "weights"])  # type: ignore[list-item]
    assert isinstance(info.value, ValueError)
    with pytest.raises(hc.BackendContractError, match="v1"):
        hc.Capabilities(v1="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # what it raised before, still caught as a ValueError
        hc.Capabilities(v1=False, v2=False)
    with pytest.raises(hc.BackendContractError, match="mode"):
        hc.DraftIo("sideways")  # type: ignore[arg-type]
    with pytest.raises(hc.PoolError, match="weights"):
        hc.PoolTransfer("weights", (0,), ("a",))  # type: ignore[arg-type]
    with pytest.raises(hc.BatchShapeError, match="host_indices"):
        hc.PoolTransfer("kv", (0.5,), ("a",))  # type: ignore[arg-type]
    with pytest.raises(HiCacheError, match="page_hashes"):
        hc.PoolTransfer("kv", (0,), 5)  # type: ignore[arg-type]
    with pytest.raises(HiCacheError, match="keys"):
        hc.PoolTransfer("kv", (0,), ("a",), keys=("abc",))  # type: ignore[arg-type]


def test_validation_error_never_escapes_a_config() -> None:
    for make in (
        lambda: StorageConfig(tp_rank="x"),
        lambda: StorageConfig.model_validate({"tp_rank": "x"}),
        lambda: StorageConfig.model_validate_json('{"tp_rank": "x"}'),
        lambda: StorageConfig().model_copy(update={"tp_rank": "x"}),
        lambda: hc.ControllerSettings(batch_pages=0),
    ):
        with pytest.raises(ConfigError) as info:
            make()
        assert "tp_rank" in str(info.value) or "batch_pages" in str(info.value)
    cfg = StorageConfig(model_name="m").model_copy(update={"batch_pages": 7})
    assert cfg.controller.batch_pages == 7 and cfg.model_name == "m"


def test_config_loader_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(HiCacheError, match="path") as info:
        load_config(5, environ={})  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    with pytest.raises(HiCacheError, match="environ"):
        load_config(environ=["HICACHE_BACKEND=file"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="HICACHE_TP_RANK"):
        load_config(environ={"HICACHE_TP_RANK": 1})  # type: ignore[dict-item]


# ------------------------------------------------------------------------ model revision
DEFAULT_KEY = (
    "default-bfloat16-page_first-459bfead1115.kv.k.tp0of1."
    "abababababababababababababababababababababababababababababababab"
)
OTHER_KEY = "org-Model-7B-float16-layer_first-9b0c22a9e519.mamba.conv_0.tp1of2-pp1of2.0123abcd"


def test_default_namespace_keeps_its_exact_keys() -> None:
    """Keys computed on dc49d5d (before ``model_revision`` existed): unset, nothing moves."""
    assert KeyScheme(StorageConfig()).keys("kv", ["k"], False, ["ab" * 32]) == [(DEFAULT_KEY,)]
    other = StorageConfig(
        model_name="org/Model-7B",
        kv_dtype="float16",
        layout="layer_first",
        tp_rank=1,
        tp_size=2,
        pp_rank=1,
        pp_size=2,
    )
    assert KeyScheme(other).keys("mamba", ["conv_0"], False, ["0123abcd"]) == [(OTHER_KEY,)]


def test_model_revision_separates_the_key_namespace() -> None:
    base = {"model_name": "org/Model-7B"}
    unset = KeyScheme(StorageConfig(**base)).namespace
    a = KeyScheme(StorageConfig(**base, model_revision="a" * 40)).namespace
    b = KeyScheme(StorageConfig(**base, model_revision="b" * 40)).namespace
    assert len({unset, a, b}) == 3
    assert a == KeyScheme(StorageConfig(**base, model_revision="a" * 40)).namespace
    assert StorageConfig(**base).model_revision is None


def test_model_revision_from_env_and_file(tmp_path: Path) -> None:
    assert load_config(environ={"HICACHE_MODEL_REVISION": "v2"}).model_revision == "v2"
    assert load_config(environ={"HICACHE_MODEL_REVISION": ""}).model_revision is None
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model_revision": "abc123"}))
    assert load_config(path, environ={}).model_revision == "abc123"
    for bad in ("", "x" * 257, 5):
        with pytest.raises(ConfigError, match="model_revision"):
            StorageConfig(model_revision=bad)


def test_two_revisions_never_share_pages(tmp_path: Path) -> None:
    hs = _hashes(3)
    with _controller(tmp_path, model_name="org/m", model_revision="rev-a") as a:
        assert a.backup(hs, [0, 1, 2]).pages == 3
        assert a.query(hs).pages == 3
    with _controller(tmp_path, model_name="org/m", model_revision="rev-b") as b:
        assert b.query(hs).pages == 0
        assert b.prefetch(hs, [3, 4, 5]).pages == 0
    with _controller(tmp_path, model_name="org/m") as unset:
        assert unset.query(hs).pages == 0
    with _controller(tmp_path, model_name="org/m", model_revision="rev-a") as again:
        assert again.query(hs).pages == 3
