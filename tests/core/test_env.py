"""``hicache_core.env`` is the one list of ``HICACHE_*`` variables: README, config and code agree with it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import hicache_core as hc
from hicache_core import env
from hicache_core.config import ControllerSettings, StorageConfig

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_is_generated_from_the_module() -> None:
    readme = (ROOT / "README.md").read_text()
    assert env.markdown_table() in readme, "README.md's table is stale: paste env.markdown_table()"


def test_config_variables_are_exactly_the_config_fields() -> None:
    fields = (set(StorageConfig.model_fields) - {"controller"}) | set(ControllerSettings.model_fields)
    assert {v.field for v in env.CONFIG_VARS} == fields


@pytest.mark.parametrize("var", env.CONFIG_VARS, ids=lambda v: v.name)
def test_config_variable_defaults_match_the_model(var: env.EnvVar) -> None:
    model = ControllerSettings if var.field in ControllerSettings.model_fields else StorageConfig
    default = model.model_fields[var.field].get_default(call_default_factory=True)
    if isinstance(default, bool):
        shown = "true" if default else "false"
    elif default is None:
        shown = "none"
    elif isinstance(default, list):
        shown = ",".join(default)
    elif isinstance(default, dict):
        shown = "{}" if not default else repr(default)
    else:
        shown = str(getattr(default, "value", default))
    assert shown == var.default


def test_every_hicache_variable_in_the_code_is_listed() -> None:
    listed = {v.name for v in env.VARIABLES}
    files = [
        p
        for d in ("hicache_core", "plugins", "integrations", "benchmarks", "scripts", "tests")
        for p in (ROOT / d).rglob("*")
        if p.suffix in (".py", ".sh", ".c")
        # hidden folders hold venvs (.venv, benchmarks/.peers) of other projects' code
        and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
        and p != Path(__file__).resolve()
    ]
    used: set[str] = set()
    for p in files:
        used |= set(re.findall(r"\bHICACHE_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(errors="replace")))
    # Names built from a prefix, names used to show that a typo is refused, and the C header guard.
    ignore = {"HICACHE_FASTIO_H", "HICACHE_MODLE_NAME", "HICACHE_BACTH_PAGES", "HICACHE_X"}
    assert used - listed - ignore == set()


def test_switches_do_not_break_config_loading() -> None:
    environ = {v.name: "1" for v in env.SWITCHES if v.type == "bool"}
    environ["HICACHE_BACKENDS_ALLOW"] = "file"
    cfg = hc.load_config(environ=environ)
    assert cfg.backend == "file"


def test_pure_python_switch_and_load_config_in_a_fresh_process() -> None:
    code = "import hicache_core as hc; print(hc.load_config().backend)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"HICACHE_PURE_PYTHON_HASH": "1", "HICACHE_REQUIRE_NATIVE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "file"


def test_unknown_variable_is_refused_with_a_suggestion() -> None:
    with pytest.raises(hc.ConfigError, match=r"HICACHE_MODLE_NAME.*did you mean HICACHE_MODEL_NAME"):
        hc.load_config(environ={"HICACHE_MODLE_NAME": "x"})


def test_config_variables_are_read() -> None:
    cfg = hc.load_config(
        environ={"HICACHE_BATCH_PAGES": "64", "HICACHE_IO_TIMEOUT_S": "none", "HICACHE_EXTENSIONS": ""}
    )
    assert cfg.controller.batch_pages == 64
    assert cfg.controller.io_timeout_s is None


def test_flags() -> None:
    for off in ("", "0", "false", "No", "OFF"):
        assert not env.env_flag("HICACHE_TRACE", {"HICACHE_TRACE": off})
    assert env.env_flag("HICACHE_TRACE", {"HICACHE_TRACE": "1"})
    assert env.env_str("HICACHE_METRICS_ADDR", {}) == "127.0.0.1"
    with pytest.raises(KeyError, match="not a hicache environment variable"):
        env.env_flag("HICACHE_NOPE", {})
