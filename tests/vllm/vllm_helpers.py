"""Helpers of the vLLM tests: run one engine in a fresh process and read its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_engine(args: dict[str, Any], timeout: float = 240.0) -> dict[str, Any]:
    """Run ``engine_worker.py`` in a fresh process; its parsed ``RESULT`` line."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_worker.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(HERE),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"engine process failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["stderr"] = proc.stderr
    return result
