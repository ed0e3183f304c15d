"""``hicache bench``: end to end on the real file backend, plus the in-process branches.

No timing assertions: figures must be present and positive, and verification must be real
(a backend that corrupts one byte on read makes the bench fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hicache_core import BackendNotFoundError, ConfigError
from hicache_core.bench import runner
from hicache_core.bench.profiles import PROFILES, build_pools, requests
from hicache_core.bench.runner import BenchRequest, run_bench
from hicache_core.cli.bench import _MODELS, parse_options
from tests.support.distinfo import installed_dist

HICACHE = [sys.executable, "-m", "hicache_core.cli"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    return subprocess.run([*HICACHE, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _check_figures(report: dict[str, Any]) -> None:
    assert report["verified"] is True, report["problems"]
    assert report["verified_bytes"] == report["bytes"] > 0
    for key in ("backup_gbps", "prefetch_gbps", "baseline_write_gbps", "baseline_read_gbps"):
        assert report[key] > 0, key
    assert report["backup_ratio"] > 0 and report["prefetch_ratio"] > 0
    assert report["baseline"] and report["elapsed_s"] > 0
    assert len(report["runs_s"]["backup"]) == report["rounds"]


def test_bench_json_defaults_verify_in_a_fresh_process() -> None:
    proc = _cli("bench", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    _check_figures(report)
    assert report["backend"] == "file" and report["model"] == "llama3-8b"
    assert report["verify_process"].startswith("fresh process")
    assert "os.write" in report["baseline"]
    assert report["draft"] == {
        "requested": False,
        "enabled": False,
        "mode": None,
        "reason": "not requested (pass --draft)",
    }


def test_bench_hybrid_with_draft_verifies() -> None:
    proc = _cli("bench", "--model", "qwen3-next", "--draft", "--json", "--pages", "48", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    _check_figures(report)
    # file declares draft "generic": draft pages are stored, restored and verified too
    assert report["draft"]["requested"] and report["draft"]["enabled"]
    assert report["draft"]["mode"] == "generic"


def test_bench_unknown_backend_lists_installed_names_without_traceback() -> None:
    proc = _cli("bench", "--backend", "nosuch", timeout=60)
    assert proc.returncode != 0
    assert "nosuch" in proc.stderr and "Installed backends:" in proc.stderr and "file" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_text_report_and_progress_bar(memory_backends: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    report = run_bench(BenchRequest(backend="memory", options={}, pages=8, rounds=1, model="deepseek-v3.2"))
    runner.render(report)
    out, err = capsys.readouterr()
    assert "verified" in out and "prefetch" in out and "baseline: memcpy" in out
    assert "backup" in err and "prefetch" in err  # the progress bars (stderr)


def test_model_choices_match_profiles() -> None:
    assert set(_MODELS) == set(PROFILES)


def test_cli_module_is_import_light() -> None:
    code = (
        "import sys, hicache_core.cli.command as c; c._parser(); "
        "print(sorted(m for m in ('torch', 'pydantic', 'rich') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("draft", [False, True])
def test_profiles_build_planned_pools(name: str, draft: bool) -> None:
    profile = PROFILES[name]
    group = build_pools(profile, 130, draft)
    assert not group.allocated
    reqs = requests(130)
    assert [r.pages for r in reqs] == [128, 2]
    assert all(p.page_nbytes > 0 for p in group.values())
    assert ("draft" in {n.value for n in group}) is draft


def test_parse_options() -> None:
    assert parse_options(None) is None
    assert parse_options('{"root": "/x"}') == {"root": "/x"}
    with pytest.raises(ConfigError, match="JSON"):
        parse_options("{nope")
    with pytest.raises(ConfigError, match="object"):
        parse_options("[1]")


def test_parse_options_from_file(tmp_path: Path) -> None:
    (tmp_path / "o.json").write_text('{"root": "/y"}')
    assert parse_options(f"@{tmp_path / 'o.json'}") == {"root": "/y"}
    with pytest.raises(ConfigError):
        parse_options(f"@{tmp_path / 'missing.json'}")


def test_unknown_backend_raises_before_side_effects() -> None:
    with pytest.raises(BackendNotFoundError, match="Installed backends"):
        run_bench(BenchRequest(backend="nosuch", progress=False))


def _small(backend: str, **kw: Any) -> BenchRequest:
    return BenchRequest(backend=backend, options={}, pages=8, rounds=1, progress=False, **kw)


def test_non_persistent_backend_is_verified_in_process_against_memcpy(memory_backends: list[str]) -> None:
    report = run_bench(_small("memory", model="deepseek-v3.2", draft=True))
    _check_figures(report)
    assert report["verify_process"].startswith("same process")
    assert report["baseline"].startswith("memcpy")
    assert report["draft"]["enabled"] and report["draft"]["mode"] == "generic"


def test_draft_disabled_by_declared_capability_is_reported(memory_backends: list[str]) -> None:
    report = run_bench(_small("memory-nodraft", model="llama3-8b", draft=True))
    assert report["verified"] is True
    assert report["draft"]["requested"] and not report["draft"]["enabled"]
    assert report["draft"]["mode"] == "unsupported" and report["draft"]["reason"]


def test_hybrid_pools_on_zero_copy_v2(memory_backends: list[str]) -> None:
    report = run_bench(_small("memory-zc", model="qwen3-next", draft=True))
    _check_figures(report)
    assert report["io_path"] == "v2"


_CORRUPT = """
from hicache_core import IoOp, hookimpl
from tests.support.membackend import MemoryBackend

class CorruptingBackend(MemoryBackend):
    '''Flips one byte of the first page it reads (and still reports success).'''

    @hookimpl
    def hicache_batch_io_v2(self, op, transfers):
        out = super().hicache_batch_io_v2(op, transfers)
        if op is IoOp.GET and transfers and len(transfers[0]):
            t = transfers[0]
            view = self.pools[t.pool].page_views([t.host_indices[0]])[0][0]
            view.view(-1)[0] ^= 0xFF
        return out
"""


def test_corrupted_bytes_fail_verification(tmp_path: Path, memory_backends: list[str]) -> None:
    with installed_dist(
        tmp_path / "corrupt",
        "hicache-test-corrupt",
        {"hicache.backends": {"corrupting": "bench_corrupting:CorruptingBackend"}},
        {"bench_corrupting": _CORRUPT},
    ):
        report = run_bench(_small("corrupting", model="llama3-8b"))
    assert report["verified"] is False
    assert report["verified_bytes"] == 0
    assert any("differ" in p for p in report["problems"]), report["problems"]


def test_metrics_snapshot_or_clear_message(
    memory_backends: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if "metrics" in runner.find_extensions():
        report = run_bench(_small("memory", model="llama3-8b", metrics=True))
        assert report["metrics"]["installed"] is True
        assert report["metrics"]["backup"] is not None and report["metrics"]["prefetch"] is not None
    monkeypatch.setattr(runner, "find_extensions", lambda: {})
    report = run_bench(_small("memory", model="llama3-8b", metrics=True))
    assert report["metrics"] == {"installed": False, "message": runner.METRICS_MISSING}
    assert report["verified"] is True
