"""Config and options files are read only when they are small regular files: a device, a FIFO or
a huge file gets a typed error at once (no endless read, no hang, no MemoryError)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hicache_core as hc
from hicache_core.config import MAX_CONFIG_FILE_BYTES
from hicache_core.testing._options import parse_options


def _fifo(tmp_path, name: str) -> str:
    path = str(tmp_path / name)
    os.mkfifo(path)
    return path


@pytest.mark.timeout(60)
def test_config_file_must_be_a_small_regular_file(tmp_path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_CONFIG_FILE_BYTES + 1))
    for path, why in (
        ("/dev/zero", "not a regular file"),
        (_fifo(tmp_path, "c.json"), "not a regular file"),
        (str(big), "larger than"),
    ):
        with pytest.raises(hc.ConfigError, match=why) as info:
            hc.StorageConfig.from_file(path)
        assert isinstance(info.value, ValueError)
        with pytest.raises(hc.ConfigError, match=why):
            hc.load_config(environ={"HICACHE_CONFIG": path})
    ok = tmp_path / "ok.json"
    ok.write_text('{"model_name": "m"}')
    assert hc.StorageConfig.from_file(ok).model_name == "m"


@pytest.mark.timeout(60)
def test_options_file_must_be_a_small_regular_file(tmp_path) -> None:
    for path in ("/dev/zero", _fifo(tmp_path, "o.json")):
        with pytest.raises(ValueError, match="not a regular file"):
            parse_options("@" + path)
    (tmp_path / "o2.json").write_text('{"root": "/x"}')
    assert parse_options("@" + str(tmp_path / "o2.json")) == {"root": "/x"}


@pytest.mark.timeout(120)
def test_cli_refuses_dev_zero_options_quickly() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_core.cli", "check", "file", "--options", "@/dev/zero"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 2, proc.stderr
    assert "not a regular file" in proc.stderr and "Traceback" not in proc.stderr
