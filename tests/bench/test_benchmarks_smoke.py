"""Smoke test of ``benchmarks/run_all.py --quick --json``: each benchmark runs and prints its figures.

No timing assertions: only that every name a module owns is reported as
``{"ratio": number, "target": number, "meets_target": bool}``. ``HICACHE_BENCH_SMOKE=1`` shrinks
the benchmarks that honour it (dispatch, cold start, scaling) to a few iterations. The other
modules that run for 20 s to minutes even in quick mode on this machine (file, mooncake) run
only with ``HICACHE_LONG_TESTS=1``. Also checks run_all's own contract: a module that is missing or raises
is recorded as an error and makes the exit status non-zero.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
RUN_ALL = BENCH / "run_all.py"
FAST = ("bench_hashing", "bench_dispatch", "bench_cold_start", "bench_scaling", "bench_metrics")
LONG = os.environ.get("HICACHE_LONG_TESTS", "") not in ("", "0")

_spec = importlib.util.spec_from_file_location("hicache_benchmarks_run_all", RUN_ALL)
assert _spec is not None and _spec.loader is not None
run_all = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_all)


def _run_all(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HICACHE_BENCH_SMOKE": "1"}
    return subprocess.run(
        [sys.executable, str(RUN_ALL), "--quick", "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _assert_entry(name: str, entry: Any) -> None:
    assert "error" not in entry, f"{name}: {entry['error']}"
    assert isinstance(entry["ratio"], (int, float)) and math.isfinite(entry["ratio"]) and entry["ratio"] > 0
    assert isinstance(entry["target"], (int, float))
    assert isinstance(entry["meets_target"], bool)


def _present() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("bench_*.py"))


def test_fast_benchmarks_run_and_report() -> None:
    modules = [m for m in FAST if m in _present()]
    proc = _run_all("--only", ",".join(modules))
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(proc.stdout)
    for module in modules:
        for name in run_all.EXPECTED.get(module, ()):
            _assert_entry(name, merged[name])
    for name, entry in merged.items():  # modules without a fixed name list (e.g. metrics)
        _assert_entry(name, entry)


@pytest.mark.parametrize("module", [m for m in _present() if m not in FAST])
def test_other_benchmarks_run_and_report(module: str) -> None:
    if not LONG:
        pytest.skip(f"{module} runs for 20 s to minutes even with --quick; set HICACHE_LONG_TESTS=1")
    if module == "bench_peers" and not (BENCH / ".peers").is_dir():
        pytest.skip("bench_peers needs the peer venvs of benchmarks/setup-peers.sh")
    if module == "bench_vllm" and not (ROOT / ".venv-vllm").is_dir():
        pytest.skip("bench_vllm needs .venv-vllm (integrations/vllm/setup-dev.sh)")
    proc = _run_all("--only", module, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(proc.stdout)
    assert merged, proc.stderr[-3000:]
    for name, entry in merged.items():
        _assert_entry(name, entry)


_OK = """
def run(quick):
    return {"ok_ratio": {"ratio": 0.5, "target": 1.0, "meets_target": False, "extra": [1, 2]}}
"""
_BOOM = """
def run(quick):
    raise RuntimeError("boom")
"""
_BAD = """
def run(quick):
    return {"bad_ratio": {"ratio": "fast", "target": 1.0, "meets_target": True}}
"""


def test_run_all_records_failures_and_exits_nonzero(tmp_path: Path) -> None:
    (tmp_path / "bench_ok.py").write_text(_OK)
    (tmp_path / "bench_boom.py").write_text(_BOOM)
    (tmp_path / "bench_bad.py").write_text(_BAD)
    proc = _run_all("--dir", str(tmp_path), "--only", "ok,boom,bad,dispatch", timeout=60)
    assert proc.returncode == 1
    merged = json.loads(proc.stdout)
    assert merged["ok_ratio"]["ratio"] == 0.5 and merged["ok_ratio"]["extra"] == [1, 2]
    assert "RuntimeError: boom" in merged["bench_boom"]["error"]
    assert merged["bench_boom"]["meets_target"] is False
    assert "ratio must be a finite number" in merged["bad_ratio"]["error"]
    assert merged["dispatch_overhead"]["error"].endswith("bench_dispatch.py is missing")
    assert merged["dispatch_overhead"]["target"] == 1.02


def test_run_all_table_without_json(tmp_path: Path) -> None:
    (tmp_path / "bench_ok.py").write_text(_OK)
    proc = subprocess.run(
        [sys.executable, str(RUN_ALL), "--quick", "--dir", str(tmp_path), "--only", "ok"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ok_ratio" in proc.stdout and "missed" in proc.stdout


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    points = [
        {"backend": "file", "batch_pages": b, "threads": t, "pages": 64, "page_bytes": 65536,
         "backup_gbps": 0.1 * b, "prefetch_gbps": 0.2 * b, "combined_gbps": 0.15 * b}
        for b in (1, 16, 128) for t in (1, 2)
    ]  # fmt: skip
    src = tmp_path / "scaling.json"
    src.write_text(json.dumps({"scaling_default_vs_best": {"points": points}}))
    out = tmp_path / "scaling.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "plot.py"), str(src), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
