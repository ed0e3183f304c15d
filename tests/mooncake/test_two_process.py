"""End to end across OS processes: A backs up through the controller and exits; B restores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hicache_mooncake.testing import MooncakeStandalone

WORKER = Path(__file__).with_name("two_process_worker.py")


def _run(action: str, options: dict[str, Any], seed: int, n: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(WORKER), action, json.dumps(options), str(seed), str(n)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, (
        f"{action} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return dict(json.loads(lines[-1]))


def test_two_processes_share_pages(mooncake_standalone: MooncakeStandalone) -> None:
    options = mooncake_standalone.options(load_env=False)
    n = 20
    a = _run("backup", options, seed=4242, n=n)
    assert a["pages"] == n and a["ok"]
    b = _run("verify", options, seed=4242, n=n)  # a fresh interpreter, after A has exited
    assert b["pages"] == n and b["pid"] != a["pid"] and b["verified_page_bytes"] > 0
