"""``hicache check`` against hostile backends: the verdict, the summary and ``--json`` survive.

A backend whose threads keep writing into its roots after close, one that never answers a GET
(interruptible, and deaf to signals), and installed pytest plugins or hypothesis writing into the
working directory. Each runs the real command in a subprocess with its own cwd and ``TMPDIR``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hicache_core.cli._check_guard import plugins_for
from tests.conformance.helpers import subprocess_env, write_dist

_BACKENDS = '''
import signal
import threading
import time

from tests.conformance.broken_backends import GoodMemory
from tests.conformance.broken_backends_file import GoodFile


class WritesAfterClose(GoodFile):
    """A heartbeat thread per store writes into its root forever (re-creating it)."""

    def __init__(self, config, options):
        super().__init__(config, options)
        root = self.root

        def beat():
            while True:
                try:
                    root.mkdir(parents=True, exist_ok=True)
                    (root / ".beat").write_text("x")
                except OSError:
                    pass
                time.sleep(0.005)

        threading.Thread(target=beat, daemon=True).start()


class HangsOnMissing(GoodMemory):
    """A GET of a key that is not stored waits for another rank to write it (forever)."""

    def get(self, key, buf):
        while key not in self.data:
            time.sleep(0.05)
        return super().get(key, buf)


class HangsDeaf(GoodMemory):
    """A GET of a missing key blocks SIGALRM, then waits: no signal handler can interrupt it."""

    def get(self, key, buf):
        if key not in self.data:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        return super().get(key, buf)
'''

_LITTERING_PLUGIN = """
from pathlib import Path


def pytest_configure(config):
    Path(".benchmarks").mkdir(exist_ok=True)  # what pytest-benchmark does in the cwd
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("robust-site")
    eps = {
        "writes-after-close": "hicache_robust:WritesAfterClose",
        "hangs-on-missing": "hicache_robust:HangsOnMissing",
        "hangs-deaf": "hicache_robust:HangsDeaf",
        "good-memory": "tests.conformance.broken_backends:GoodMemory",
    }
    write_dist(
        root, "hicache-robust", eps, {"hicache_robust": _BACKENDS, "littering_plugin": _LITTERING_PLUGIN}
    )
    info = root / "hicache_robust-0.0.1.dist-info" / "entry_points.txt"
    info.write_text(info.read_text() + "[pytest11]\nlitter = littering_plugin\n")
    return root


def _check(
    site: Path, tmp: Path, *args: str, timeout: float = 300
) -> tuple[subprocess.CompletedProcess[str], Any]:
    """``hicache check ARGS --json`` in an empty cwd with its own TMPDIR; the process and the JSON."""
    cwd, tmpdir, out = tmp / "cwd", tmp / "tmp", tmp / "check.json"
    cwd.mkdir()
    tmpdir.mkdir()
    env = subprocess_env(site) | {"TMPDIR": str(tmpdir)}
    name, *rest = args
    cmd = [sys.executable, "-m", "hicache_core.cli", "check", name, "-q", "--json", str(out), *rest]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    data = json.loads(out.read_text()) if out.exists() else None
    return proc, data


def _outcomes(data: Any) -> dict[str, tuple[str, str]]:
    return {t["test"]: (t["outcome"], t["detail"]) for t in data["tests"]}


def test_writes_after_close_fail_the_backend_not_the_command(site: Path, tmp_path: Path) -> None:
    proc, data = _check(site, tmp_path, "writes-after-close", "--", "-k", "v1_roundtrip")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data is not None and data["verdict"] == "failed"
    outcome, detail = _outcomes(data)["cleanup"]
    assert outcome == "failed" and detail.startswith("files still being written after close: "), detail
    assert str(tmp_path / "tmp") in detail and "test_v1_roundtrip" in detail
    assert next(t for t in data["tests"] if t["test"] == "cleanup")["rules"] == ["R2"]
    assert data["rules"]["R2"]["result"] == "failed"
    assert "FAILED cleanup: files still being written after close" in proc.stdout
    assert data["totals"]["passed"] > 0  # the suite's own verdicts are kept
    assert "backend 'writes-after-close': FAILED" in proc.stdout


def test_a_test_that_hangs_fails_after_the_time_limit(site: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    args = ("hangs-on-missing", "--test-timeout", "2", "--", "-k", "v1_get_missing or discovery_open")
    proc, data = _check(site, tmp_path, *args)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - start < 120
    outcomes = _outcomes(data)
    outcome, detail = outcomes["test_v1_get_missing"]
    assert outcome == "failed" and detail.startswith("test exceeded 2 s: the backend did not answer"), detail
    assert "hicache_robust.py" in detail and " get" in detail  # where it was stuck
    assert outcomes["test_discovery_open_close"][0] == "passed"
    assert "FAILED test_v1_get_missing: test exceeded 2 s" in proc.stdout
    assert not list((tmp_path / "tmp").iterdir())


def test_a_hang_no_signal_interrupts_ends_the_run_with_a_summary(site: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    args = ("hangs-deaf", "--test-timeout", "1", "--", "-k", "discovery_open or v1_get_missing")
    proc, data = _check(site, tmp_path, *args, timeout=120)
    assert time.monotonic() - start < 100
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    outcome, detail = _outcomes(data)["test_v1_get_missing"]
    assert outcome == "failed" and "could not be interrupted" in detail and "the run was stopped" in detail
    assert data["verdict"] == "failed"
    assert "backend 'hangs-deaf': FAILED" in proc.stdout


def test_nothing_is_left_in_the_working_directory(site: Path, tmp_path: Path) -> None:
    """An auto-loadable pytest plugin that writes into the cwd is not loaded; hypothesis (the
    stateful group) keeps its files in the run's temporary directory."""
    proc, data = _check(site, tmp_path, "good-memory", "--", "-k", "stateful or discovery_open")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["totals"]["passed"] >= 2 and data["groups"]["stateful"]["passed"] >= 1
    assert sorted(p.name for p in (tmp_path / "cwd").iterdir()) == []
    assert not list((tmp_path / "tmp").iterdir())
    # the plugin is real: plain pytest in the same environment auto-loads it
    env = subprocess_env(site)
    probe = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-q", "nosuchdir"]
    subprocess.run(probe, cwd=tmp_path / "cwd", env=env, capture_output=True, timeout=120, check=False)
    assert (tmp_path / "cwd" / ".benchmarks").is_dir()


def test_test_timeout_must_be_seconds(site: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "hicache_core.cli", "check", "good-memory", "--test-timeout", "-1"]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=subprocess_env(site), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "--test-timeout: expected a number of seconds >= 0" in proc.stderr


def test_options_after_dashes_load_their_plugin() -> None:
    assert plugins_for(["-n", "2"]) == ["-p", "xdist"]
    assert plugins_for(["-n2", "--timeout=5"]) == ["-p", "xdist", "-p", "timeout"]
    assert plugins_for(["-p", "xdist", "-n", "2"]) == []
    assert plugins_for(["-o", "timeout=120", "-k", "v1"]) == ["-p", "timeout"]
    assert plugins_for(["--override-ini=timeout=5"]) == ["-p", "timeout"]
    assert plugins_for(["-k", "v1", "--no-summary", "-x", "-o", "xfail_strict=true"]) == []


def test_options_refused_by_the_environment_are_not_a_contract_breach() -> None:
    """A validator raising ConfigError/OptionsError (the operator's settings) leaves the class
    sound; any other failure of ``Options()`` is the plugin author's."""
    from pydantic import BaseModel, ConfigDict, model_validator

    from hicache_core import BackendContractError, ConfigError
    from hicache_core.plugin.registry import defaults_error, validate_backend_class
    from tests.conformance.broken_backends import GoodMemory

    def backend(error: Exception) -> type:
        class Options(BaseModel):
            model_config = ConfigDict(extra="forbid")

            @model_validator(mode="after")
            def _env(self) -> Options:
                raise error

        return type("FromEnv", (GoodMemory,), {"Options": Options})

    operator = backend(ConfigError("environment variable X_MODE: bad; unset it"))
    validate_backend_class(operator, "x")
    assert "X_MODE" in str(defaults_error(operator))
    author = backend(ValueError("a field without a default"))
    with pytest.raises(BackendContractError, match="constructible with defaults"):
        validate_backend_class(author, "x")
    assert defaults_error(author) is None
