"""``benchmarks/bench_peers.py`` without the peer venvs: missing and failing peers are never wins.

The peer venvs (``benchmarks/setup-peers.sh``) are not built here; ``HICACHE_PEERS_DIR`` points
the benchmark at a directory this test fills: nothing (every peer missing), a ``nixl`` venv whose
python exits at once (its three settings fail), and an ``sglang`` "venv" whose python is this
interpreter (which has SGLang 0.5.23 from ``integrations/sglang/setup-dev.sh``), so one real peer
runs and the figure has a ratio that still must not meet its target while others are missing.
The worker protocol's byte check is tested on its own with a contender that flips one byte.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_peers.py"
PEER_ROWS = {
    "LMCache local disk",
    "LMCache local disk, O_DIRECT",
    "SGLang HiCacheFile",
    "NIXL POSIX, AIO (default)",
    "NIXL POSIX, io_uring",
    "NIXL POSIX, io_uring + O_DIRECT",
}
FIGURES = ("file_vs_best_peer_durable", "file_vs_best_peer_cold", "file_vs_best_peer_warm")


def _bench(peers_dir: Path, tmp: Path) -> dict[str, Any]:
    env = {**os.environ, "HICACHE_BENCH_SMOKE": "1", "HICACHE_PEERS_DIR": str(peers_dir)}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--dir", str(tmp)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout))


def _fake_python(path: Path, script: str) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


def test_missing_peers_are_reported_and_never_win(tmp_path: Path) -> None:
    res = _bench(tmp_path / "no-peers", tmp_path)
    assert set(res) == set(FIGURES)
    for name in FIGURES:
        fig = res[name]
        assert fig["ratio"] is None, name  # nothing to compare with: no number at all
        assert fig["meets_target"] is False
        assert fig["complete"] is False
        assert set(fig["missing"]) == PEER_ROWS
        assert fig["failed"] == {}
        table = fig["table"]
        for row in PEER_ROWS:
            assert "missing" in table[row] and table[row]["256KiB_cold_gbps"] is None
        hicache = [r for r in table.values() if r["kind"] == "hicache"]
        assert hicache and all(r["256KiB_cold_gbps"] and r["2048KiB_warm_gbps"] for r in hicache)
        assert all(not r.get("errors") for r in hicache)
        assert table["raw: one file, O_DIRECT"]["2048KiB_durable_gbps"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed in this venv")
def test_failed_peer_is_not_a_win_and_one_real_peer_gives_a_ratio(tmp_path: Path) -> None:
    peers = tmp_path / "peers"
    _fake_python(peers / "nixl" / "bin" / "python", "echo 'no nixl here' >&2; exit 3")
    _fake_python(peers / "sglang" / "bin" / "python", f'exec "{sys.executable}" "$@"')
    res = _bench(peers, tmp_path)
    for name in FIGURES:
        fig = res[name]
        nixl = {r for r in PEER_ROWS if r.startswith("NIXL")}
        assert set(fig["failed"]) == nixl, fig["failed"]
        assert all("without an answer" in why and "no nixl here" in why for why in fig["failed"].values())
        assert set(fig["missing"]) == {r for r in PEER_ROWS if r.startswith("LMCache")}
        assert fig["table"]["SGLang HiCacheFile"]["versions"]["sglang"]
        for size in ("256KiB", "2048KiB"):
            assert fig["per_size"][size]["best_peer"] == "SGLang HiCacheFile"
        assert isinstance(fig["ratio"], float) and fig["ratio"] > 0
        assert fig["complete"] is False and fig["meets_target"] is False


def _common_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "peers_common", ROOT / "benchmarks" / "peers" / "_common.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _DictStore:
    """A contender keeping its pages in files, optionally handing one byte back flipped."""

    def __init__(self, root: str, page_bytes: int, n: int, setting: str) -> None:
        self.root, self.n, self.flip = root, n, setting == "flip"
        self.src = [b""] * n
        self.dst = [b""] * n

    def fill(self, i: int, data: memoryview) -> None:
        self.src[i] = bytes(data)

    def write(self) -> None:
        for i, b in enumerate(self.src):
            with open(os.path.join(self.root, f"{i}.bin"), "wb") as f:
                f.write(b)

    def clear(self) -> None:
        self.dst = [b""] * self.n

    def read(self) -> int:
        for i in range(self.n):
            with open(os.path.join(self.root, f"{i}.bin"), "rb") as f:
                self.dst[i] = f.read()
        if self.flip:
            self.dst[1] = bytes([self.dst[1][0] ^ 1]) + self.dst[1][1:]
        return self.n

    def page(self, i: int) -> bytes:
        return self.dst[i]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("setting", ["exact", "flip"])
def test_every_byte_is_checked(tmp_path: Path, setting: str) -> None:
    common = _common_module()
    out = common.run_case(_DictStore, 7, str(tmp_path), setting, 8192, 4)
    assert out["files"] == 4
    if setting == "exact":
        assert out["error"] is None and out["wrong_pages"] == 0
        assert out["durable_s"] > 0 and out["cold_s"] > 0 and out["warm_s"] > 0
    else:
        assert out["wrong_pages"] == 1
        assert "1 pages with wrong bytes" in out["error"]
    pages = common.Pages(7, 8192, 4)
    assert len({bytes(pages[i]) for i in range(4)}) == 4  # no two pages alike
