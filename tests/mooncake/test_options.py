"""Pure logic: options, environment loading, sizing with small fake pools, declared capabilities."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from hicache_mooncake import MooncakeBackend, MooncakeOptions
from hicache_mooncake._options import ENV_FIELDS, parse_size, resolve_device

from hicache_core import BackendContractError, DraftIoMode, OptionsError, PoolError, StorageConfig
from hicache_core.plugin.registry import clear_caches, describe_backend, load_backend_class
from hicache_core.plugin.store import validate_options
from hicache_core.sizing import standalone_required_bytes


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, _ in ENV_FIELDS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", raising=False)


def test_defaults_follow_sglang_names() -> None:
    o = MooncakeOptions()
    assert o.metadata_server == "P2PHANDSHAKE"
    assert o.protocol == "tcp"
    assert o.device_name == ""
    assert o.standalone_storage is False and o.client_server_address is None
    assert o.global_segment_size == 4 << 30 and o.local_buffer_size == 16 << 20
    assert 0 < o.setup_timeout_s <= 5.0
    assert o.max_keys_per_call <= 2048


def test_entry_point_and_declared_capabilities() -> None:
    assert load_backend_class("mooncake") is MooncakeBackend
    row = describe_backend("mooncake")
    assert row["distribution"] == "hicache-mooncake" and row["status"] == "ok"
    caps = row["capabilities"]
    assert caps["v2"] and caps["zero_copy"] and caps["shared"] and caps["v1"]
    assert caps["draft_io"] == "zero_copy_v2"
    assert set(caps["pools"]) >= {"kv", "mamba", "indexer", "draft"}


def test_unknown_option_is_refused_with_field_path() -> None:
    with pytest.raises(OptionsError) as err:
        validate_options(MooncakeBackend, "mooncake", {"master_addr": "x:1"})
    assert "master_addr" in str(err.value) and "mooncake" in str(err.value)
    with pytest.raises(OptionsError, match="max_keys_per_call"):
        validate_options(MooncakeBackend, "mooncake", {"max_keys_per_call": 4096})
    with pytest.raises(OptionsError, match="client_server_address"):
        validate_options(MooncakeBackend, "mooncake", {"standalone_storage": True, "load_env": False})
    with pytest.raises(OptionsError, match="host:port"):
        validate_options(MooncakeBackend, "mooncake", {"master_server_address": "nohostport"})


@pytest.mark.parametrize(
    ("text", "value"),
    [("4gb", 4 << 30), ("512 MB", 512 << 20), ("16MiB", 16 << 20), ("1G", 1 << 30), ("123", 123), (77, 77)],
)
def test_sizes(text: Any, value: int) -> None:
    assert parse_size(text) == value
    assert MooncakeOptions(global_segment_size=text).global_segment_size == value


def test_bad_size() -> None:
    with pytest.raises(ValueError, match="4gb"):
        parse_size("lots")


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_CLIENT", "10.0.0.2:50052")
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "http://10.0.0.1:8080/metadata")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "2gb")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    monkeypatch.setenv("MOONCAKE_DEVICE", '{"0": "mlx5_0", "1": "mlx5_1"}')
    monkeypatch.setenv("MOONCAKE_STANDALONE_STORAGE", "true")
    monkeypatch.setenv("LOCAL_HOSTNAME", "node7")
    monkeypatch.setenv("SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE", "8mb")
    o = MooncakeOptions()
    assert o.master_server_address == "10.0.0.1:50051"
    assert o.client_server_address == "10.0.0.2:50052"
    assert o.metadata_server.startswith("http://")
    assert o.global_segment_size == 2 << 30 and o.local_buffer_size == 8 << 20
    assert o.protocol == "rdma" and o.standalone_storage and o.local_hostname == "node7"
    assert resolve_device(o.device_name, 1) == "mlx5_1"
    # explicit options win over the environment; load_env=False ignores it
    assert MooncakeOptions(master_server_address="h:1").master_server_address == "h:1"
    assert MooncakeOptions(load_env=False).master_server_address == "127.0.0.1:50051"
    # MOONCAKE_LOCAL_HOSTNAME wins over the legacy LOCAL_HOSTNAME
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "node8")
    assert MooncakeOptions().local_hostname == "node8"
    # a bad value names the variable
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="MOONCAKE_PROTOCOL"):
        MooncakeOptions()


def test_sglang_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"master_server_address": "file:1", "global_segment_size": "1gb"}))
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(cfg))
    monkeypatch.setenv("MOONCAKE_MASTER", "env:2")
    o = MooncakeOptions()
    assert o.master_server_address == "file:1" and o.global_segment_size == 1 << 30
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
        MooncakeOptions()


def test_draft_capability_depends_on_split_heads() -> None:
    hook = MooncakeBackend.hicache_draft_io_capability
    plain = hook(cast(Any, SimpleNamespace(config=StorageConfig(backend="mooncake"))))
    assert plain.mode is DraftIoMode.ZERO_COPY_V2
    split = hook(
        cast(Any, SimpleNamespace(config=StorageConfig(backend="mooncake", should_split_heads=True)))
    )
    assert split.mode is DraftIoMode.UNSUPPORTED and "should_split_heads" in split.reason


class _FakePool:
    def __init__(self, *sizes: int, share: torch.Tensor | None = None) -> None:
        self._bufs = [share] if share is not None else [torch.empty(n, dtype=torch.uint8) for n in sizes]

    def buffers(self) -> list[torch.Tensor]:
        return self._bufs


def test_standalone_sizing_small_fakes() -> None:
    kv = _FakePool(128)
    mamba = _FakePool(64, 32)  # temporal + one conv buffer
    assert standalone_required_bytes({"kv": kv, "mamba": mamba}) == 224
    # a draft pool sharing the KV buffer is counted once (dedup by data pointer)
    draft = _FakePool(share=kv.buffers()[0])
    assert standalone_required_bytes({"kv": kv, "mamba": mamba, "draft": draft}) == 224
    indexer = _FakePool(40)
    assert standalone_required_bytes({"kv": kv, "mamba": mamba, "indexer": indexer}) == 264
    with pytest.raises(PoolError, match="kv"):
        standalone_required_bytes({"mamba": mamba})
    with pytest.raises(PoolError, match="missing"):
        standalone_required_bytes({"kv": kv, "mamba": None})


def test_sglang_config_file_must_be_a_small_regular_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (5 << 20) + b"{}")
    for path in (fifo, "/dev/zero", big):  # a FIFO must not block, /dev/zero must not be read forever
        monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
        with pytest.raises(ValueError, match="SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
            MooncakeOptions()


@pytest.mark.parametrize(
    ("var", "value", "field"),
    [
        ("MOONCAKE_MASTER", "nohost", None),  # checked by the plugin itself
        ("MOONCAKE_SETUP_TIMEOUT", "abc", "setup_timeout_s"),  # refused by the field's type
        ("MOONCAKE_CHECK_SERVER", "maybe", "check_server"),
    ],
)
def test_bad_environment_is_the_operators_error(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, field: str | None
) -> None:
    """Listing shows the backend installed and sound, with the variable to fix; opening it raises
    an OptionsError naming the variable and the fix, never a BackendContractError."""
    monkeypatch.setenv(var, value)
    clear_caches()
    assert load_backend_class("mooncake") is MooncakeBackend
    row = describe_backend("mooncake")
    assert row["status"].startswith(f"misconfigured: environment variable {var}"), row["status"]
    assert f"set {var} to a valid value or unset it" in row["status"]
    assert row["capabilities"] is not None and row["capabilities"]["v2"]
    if field is not None:
        assert f"option {field!r}" in row["status"]
    with pytest.raises(OptionsError, match=f"environment variable {var}") as err:
        validate_options(MooncakeBackend, "mooncake", {})
    assert not isinstance(err.value, BackendContractError)
    explicit = {"master_server_address": "h:1", "setup_timeout_s": 1.0, "check_server": False}
    assert validate_options(MooncakeBackend, "mooncake", explicit)  # explicit options win
    assert validate_options(MooncakeBackend, "mooncake", {"load_env": False})


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("[1]", "must hold a JSON object"),
        ("{nope", "is not a readable JSON file"),
        ('{"master_addr": "h:1"}', "sets 'master_addr', which is not a mooncake option"),
        ('{"replica_num": 99}', "sets option 'replica_num' to a bad value"),
        (None, "not a regular file"),  # a FIFO
    ],
)
def test_bad_sglang_config_file_is_the_operators_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str | None, words: str
) -> None:
    path = tmp_path / "mooncake.json"
    if content is None:
        os.mkfifo(path)
    else:
        path.write_text(content)
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    clear_caches()
    assert load_backend_class("mooncake") is MooncakeBackend
    status = describe_backend("mooncake")["status"]
    assert status.startswith(f"misconfigured: SGLANG_HICACHE_MOONCAKE_CONFIG_PATH={str(path)!r}"), status
    assert words in status and "or unset it" in status
    with pytest.raises(OptionsError, match="SGLANG_HICACHE_MOONCAKE_CONFIG_PATH") as err:
        validate_options(MooncakeBackend, "mooncake", {})
    assert words in str(err.value) and not isinstance(err.value, BackendContractError)
