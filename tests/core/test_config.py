"""StorageConfig: validation, file formats, environment, flat controller settings."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import hicache_core as hc
from hicache_core import ConfigError, StorageConfig, load_config


def test_defaults_and_flat_controller_fields() -> None:
    cfg = StorageConfig()
    assert cfg.backend == "file" and cfg.controller.batch_pages == 128
    assert cfg.controller.prefetch_policy is hc.PrefetchPolicy.BEST_EFFORT
    flat = StorageConfig(batch_pages=64, prefetch_policy="timeout", io_threads=4)
    assert flat.controller.batch_pages == 64 and flat.controller.io_threads == 4


@pytest.mark.parametrize(
    "bad",
    [{"tp_rank": 2, "tp_size": 2}, {"batch_pages": 0}, {"bogus": 1}, {"layout": "diagonal"}, {"tp_size": -1}],
)
def test_invalid_configs(bad) -> None:
    with pytest.raises(ConfigError):
        load_config(environ={}, **bad)


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_file_formats(tmp_path: Path, suffix: str) -> None:
    body = {
        ".toml": 'backend = "file"\nmodel_name = "m"\ntp_size = 2\ntp_rank = 1\n[options]\nroot = "/x"\n',
        ".yaml": "backend: file\nmodel_name: m\ntp_size: 2\ntp_rank: 1\noptions:\n  root: /x\n",
        ".json": json.dumps(
            {"backend": "file", "model_name": "m", "tp_size": 2, "tp_rank": 1, "options": {"root": "/x"}}
        ),
    }[suffix]
    path = tmp_path / f"c{suffix}"
    path.write_text(body)
    cfg = StorageConfig.from_file(path)
    assert (cfg.model_name, cfg.tp_rank, cfg.options) == ("m", 1, {"root": "/x"})


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("backend = [")
    with pytest.raises(ConfigError, match=r"c\.toml"):
        StorageConfig.from_file(path)
    with pytest.raises(ConfigError, match="unknown format"):
        StorageConfig.from_file(tmp_path / "x.ini") if (tmp_path / "x.ini").write_text("a") else None
    with pytest.raises(ConfigError, match="cannot read"):
        StorageConfig.from_file(tmp_path / "missing.toml")


def test_environment_overrides_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model_name": "file-model", "options": {"a": 1}}))
    env = {
        "HICACHE_CONFIG": str(path),
        "HICACHE_MODEL_NAME": "env-model",
        "HICACHE_OPTIONS": '{"b": 2}',
        "HICACHE_BATCH_PAGES": "32",
        "HICACHE_EXTENSIONS": "metrics, tracing",
        "HICACHE_BACKENDS_BLOCK": "x",
    }
    cfg = load_config(environ=env)
    assert StorageConfig.load(environ=env) == cfg
    assert cfg.model_name == "env-model" and cfg.options == {"a": 1, "b": 2}
    assert cfg.controller.batch_pages == 32 and cfg.extensions == ["metrics", "tracing"]


def test_unknown_env_var_is_an_error() -> None:
    with pytest.raises(ConfigError, match="HICACHE_MODLE_NAME"):
        load_config(environ={"HICACHE_MODLE_NAME": "x"})


def test_bad_env_json() -> None:
    with pytest.raises(ConfigError, match="HICACHE_OPTIONS"):
        load_config(environ={"HICACHE_OPTIONS": "{nope"})


def test_decode_forces_no_buffer(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hicache"):
        cfg = StorageConfig(disaggregation_mode="decode", mamba_scheduler_strategy="extra_buffer")
    assert cfg.mamba_scheduler_strategy == "no_buffer"
    assert sum("no_buffer" in r.getMessage() for r in caplog.records) == 1


def test_metrics_flag_enables_extension() -> None:
    assert StorageConfig(enable_storage_metrics=True).extensions == ["metrics"]
