"""Crash consistency: a writer SIGKILLed at random moments never leaves a torn page readable.

A pre-forked "zygote" (torch and hicache imported once) forks a fresh writer per round, which
backs pages up in a loop; the test kills it with SIGKILL after a random delay, then the zygote
forks a fresh verifier that reopens the store: every page it reports present must read back
byte-exact, and every page of a batch the writer logged as done must be present (a process
crash loses nothing that was acknowledged: the kernel keeps written data).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.reliability._util import (
    backend_listed,
    hex_hash,
    local_store_backends,
    report,
    temp_files,
)

ROOT_DIR = Path(__file__).resolve().parents[2]
BATCH = 16


class Zygote:
    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability._worker", "zygote"],
            cwd=ROOT_DIR,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"zygote died (exit {self.proc.poll()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _progress(path: Path) -> tuple[int, list[int], bool]:
    """(last started batch or -1, batches logged done, whether the writer got ready)."""
    started, done, ready = -1, [], False
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["ready"]:
            ready = True
        elif parts[:1] == ["start"]:
            started = max(started, int(parts[1]))
        elif parts[:1] == ["done"] and len(parts) == 3 and int(parts[2]) == BATCH:
            done.append(int(parts[1]))
    return started, done, ready


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", local_store_backends())
def test_sigkill_never_exposes_torn_pages(
    backend: str, tmp_path: Path, long_mode: bool, record_property
) -> None:
    if not backend_listed(backend):
        pytest.skip(f"`hicache backends` does not list {backend!r} as usable")
    kills = 100 if long_mode else 10
    rng = random.Random(20261122)
    root = tmp_path / "store"
    zygote = Zygote()
    totals = {"kills": 0, "batches_started": 0, "batches_done": 0, "pages_checked": 0, "pages_present": 0}
    totals.update({"bytes_verified": 0, "torn": 0, "unreadable": 0, "lost": 0, "partial_pages": 0})
    old: list[str] = []
    pid = 0
    t0 = time.monotonic()
    try:
        for round_ in range(kills):
            ns = f"r{round_}"
            progress = tmp_path / f"progress-{round_}.log"
            progress.touch()
            pid = zygote.call(
                op="writer", backend=backend, root=str(root), ns=ns, progress=str(progress), batch=BATCH
            )["pid"]
            deadline = time.monotonic() + 30
            while not _progress(progress)[2]:  # wait until the store is open
                assert time.monotonic() < deadline, "writer never opened the store"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.01, 0.25))
            os.kill(pid, signal.SIGKILL)
            status = zygote.call(op="reap", pid=pid)["status"]
            pid = 0
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"writer ended early: {status}"
            )
            started, done, _ = _progress(progress)
            hashes = [hex_hash(ns, i) for i in range((started + 1) * BATCH)]
            must = [hex_hash(ns, b * BATCH + i) for b in done for i in range(BATCH)]
            sample = rng.sample(old, min(len(old), 64))  # earlier rounds must be untouched
            res = zygote.call(
                op="verify",
                backend=backend,
                root=str(root),
                hashes=hashes + sample,
                must_exist=must + sample,
                result_path=str(tmp_path / "verify.json"),
            )
            assert res["status"] == 0, "verifier crashed (see stderr)"
            r = res["result"]
            totals["kills"] += 1
            totals["batches_started"] += started + 1
            totals["batches_done"] += len(done)
            totals["pages_checked"] += r["checked"]
            totals["pages_present"] += r["present"]
            totals["partial_pages"] += r["partial"]
            for k in ("bytes_verified", "torn", "unreadable", "lost"):
                totals[k] += r[k]
            old.extend(must)
    finally:
        if pid:  # a failure between spawn and kill: never leave a writer running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        zygote.close()
    totals["temp_files_left"] = len(temp_files(root))
    totals["seconds"] = round(time.monotonic() - t0, 1)
    report(record_property, f"crash-{backend}", **totals)
    assert totals["kills"] >= kills
    assert totals["torn"] == 0, "a torn page was returned as data"
    assert totals["unreadable"] == 0, "a page reported present could not be read"
    assert totals["lost"] == 0, "a page acknowledged before the crash is gone"
    assert totals["pages_present"] > 0
