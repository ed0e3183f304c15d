"""Concurrency: 8 threads x 2 processes back up and prefetch overlapping pages of one store.

Both processes write the same deterministic bytes for a page hash (pages are content
addressed), so any corruption, torn read or lost page shows up as a byte mismatch. Each worker
verifies every page it prefetches; the test bounds the wall time (no deadlock).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability._util import backend_listed, local_store_backends, report

ROOT_DIR = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", local_store_backends())
def test_threads_and_processes_share_a_store(
    backend: str, tmp_path: Path, long_mode: bool, record_property
) -> None:
    if not backend_listed(backend):
        pytest.skip(f"`hicache backends` does not list {backend!r} as usable")
    if backend not in ("file", "file-segments") and not long_mode:
        pytest.skip("the hf3fs variant runs with --long (CI time budget); the file store is the CI case")
    rounds = 60 if long_mode else 12
    args = {
        "backend": backend,
        "root": str(tmp_path / "store"),
        "threads": 8,
        "rounds": rounds,
        "span": 96,
        "window": 16,
    }
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.reliability._worker",
                "concurrency",
                json.dumps({**args, "seed": p}),
            ],
            cwd=ROOT_DIR,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=200)
            assert p.returncode == 0, f"worker exited with {p.returncode}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.monotonic() - t0
    totals = {
        k: sum(o[k] for o in outs)
        for k in ("backups", "prefetches", "pages_written", "pages_read", "bytes_verified")
    }
    errors = [e for o in outs for e in o["errors"]]
    report(
        record_property,
        f"concurrency-{backend}",
        processes=2,
        threads=8,
        **totals,
        errors=len(errors),
        worker_seconds=[round(o["seconds"], 1) for o in outs],
        wall_seconds=round(wall, 1),
    )
    assert not errors, errors[:5]
    assert totals["pages_read"] == 2 * 8 * rounds * 16
