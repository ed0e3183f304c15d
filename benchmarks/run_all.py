"""Run every ``benchmarks/bench_*.py`` and merge their figures into one JSON object.

Each module is imported by path and its ``run(quick: bool) -> dict`` called; the result maps
benchmark names to at least ``{"ratio": float, "target": float, "meets_target": bool}``. The
merged object maps every name below (plus anything else a module reports) to such an entry:

========================================  =================  ==========================
name                                      module             ratio (target)
========================================  =================  ==========================
``page_hashes_vs_hashlib``                bench_hashing      throughput ratio (>= 0.6)
``page_hashes_vs_per_token_loop``         bench_hashing      throughput ratio (>= 20)
``dispatch_overhead``                     bench_dispatch     hooked / direct time (<= 1.02)
``file_vs_raw_io``                        bench_file         throughput ratio (>= 0.9)
``exists_vs_raw``                         bench_file         time ratio (<= 1.2)
``mooncake_vs_raw_client``                bench_mooncake     throughput ratio (>= 0.95)
``nixl_vs_raw``                           bench_nixl         throughput ratio (>= 0.9)
``cold_start_vs_python``                  bench_cold_start   time ratio (within 0.3 s)
``scaling_default_vs_best``               bench_scaling      throughput ratio (>= 0.8)
``metrics_overhead``                      bench_metrics      time ratio (<= 1.03)
``file_cold_prefetch_vs_raw_limit``       bench_file         GB/s ratio (>= 0.9)
``file_durable_backup_vs_raw_limit``      bench_file         GB/s ratio (>= 0.8)
``file_vs_best_peer_cold``                bench_peers        GB/s ratio (>= 1.2)
``file_vs_best_peer_durable``             bench_peers        GB/s ratio (>= 1.5)
``file_vs_best_peer_warm``                bench_peers        GB/s ratio (>= 1.0)
``vllm_ttft_hicache_vs_recompute``        bench_vllm         TTFT ratio (<= 0.5)
``vllm_load_vs_controller``               bench_vllm         GB/s ratio (>= 0.9)
``vllm_save_vs_controller``               bench_vllm         GB/s ratio (>= 0.9)
========================================  =================  ==========================

``bench_vllm`` runs only where ``.venv-vllm/`` exists (``integrations/vllm/setup-dev.sh``).
``bench_peers`` runs only with ``--peers`` (or when named in ``--only``): it needs the peer venvs
of ``benchmarks/setup-peers.sh`` and takes minutes even in ``--quick``.

A module that is missing or raises is recorded as ``{"error": ..., "ratio": null,
"meets_target": false}`` under each of its names, and the exit status is then 1. A name reported
by a module other than its owner (e.g. a second ``exists_vs_raw``) is kept as ``name@module``.
Missed targets do not change the exit status unless ``--strict`` is given.

Run: ``python benchmarks/run_all.py [--quick] [--json] [--only hashing,dispatch,...] [--peers] [--strict]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

EXPECTED: dict[str, tuple[str, ...]] = {
    "bench_hashing": ("page_hashes_vs_hashlib", "page_hashes_vs_per_token_loop"),
    "bench_dispatch": ("dispatch_overhead",),
    "bench_file": (
        "file_vs_raw_io",
        "exists_vs_raw",
        "file_cold_prefetch_vs_raw_limit",
        "file_durable_backup_vs_raw_limit",
    ),
    "bench_mooncake": ("mooncake_vs_raw_client",),
    "bench_nixl": ("nixl_vs_raw",),
    "bench_cold_start": ("cold_start_vs_python",),
    "bench_scaling": ("scaling_default_vs_best",),
    "bench_metrics": ("metrics_overhead",),
    "bench_peers": ("file_vs_best_peer_cold", "file_vs_best_peer_durable", "file_vs_best_peer_warm"),
    "bench_vllm": ("vllm_ttft_hicache_vs_recompute", "vllm_load_vs_controller", "vllm_save_vs_controller"),
}
OPT_IN = {"bench_peers"}  # run only with --peers or when named in --only
TARGETS: dict[str, float] = {
    "page_hashes_vs_hashlib": 0.6,
    "page_hashes_vs_per_token_loop": 20.0,
    "dispatch_overhead": 1.02,
    "file_vs_raw_io": 0.9,
    "exists_vs_raw": 1.2,
    "file_cold_prefetch_vs_raw_limit": 0.9,
    "file_durable_backup_vs_raw_limit": 0.8,
    "mooncake_vs_raw_client": 0.95,
    "nixl_vs_raw": 0.9,
    "scaling_default_vs_best": 0.8,
    "metrics_overhead": 1.03,
    "file_vs_best_peer_cold": 1.2,
    "file_vs_best_peer_durable": 1.5,
    "file_vs_best_peer_warm": 1.0,
    "vllm_ttft_hicache_vs_recompute": 0.5,
    "vllm_load_vs_controller": 0.9,
    "vllm_save_vs_controller": 0.9,
}
# bench_vllm runs only where integrations/vllm/setup-dev.sh created .venv-vllm/ (vLLM's own venv).
NEEDS_VLLM_VENV = {"bench_vllm"}
VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"
# The two benchmarks that create (and at the end delete) thousands of files run back to back,
# followed by ones that create none: on an ext4 without a journal, file creation stays several
# times slower for up to ~80 s after a mass deletion (see README.md), so bench_scaling's cleanup
# must not land just before the next run's bench_file.
ORDER = (
    "bench_cold_start",
    "bench_hashing",
    "bench_dispatch",
    "bench_file",
    "bench_scaling",
    "bench_mooncake",
)


def _error(name: str, message: str) -> dict[str, Any]:
    return {"ratio": None, "target": TARGETS.get(name), "meets_target": False, "error": message}


def _valid(entry: Any) -> str | None:
    """Why ``entry`` is not a ``{ratio, target, meets_target}`` record (None if it is)."""
    if not isinstance(entry, dict):
        return f"expected a dict, got {type(entry).__name__}"
    ratio = entry.get("ratio")
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not math.isfinite(ratio):
        return f"ratio must be a finite number, got {ratio!r}"
    if not isinstance(entry.get("target"), (int, float)):
        return f"target must be a number, got {entry.get('target')!r}"
    if not isinstance(entry.get("meets_target"), bool):
        return f"meets_target must be a bool, got {entry.get('meets_target')!r}"
    return None


def load(path: Path) -> Any:
    """Import a benchmark module by path (its directory goes on ``sys.path`` for siblings)."""
    spec = importlib.util.spec_from_file_location(f"hicache_benchmarks_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_module(path: Path, quick: bool) -> tuple[dict[str, Any], float]:
    """``run(quick)`` of one module, its stdout sent to stderr; returns (result, seconds)."""
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        result = load(path).run(quick)
    if not isinstance(result, dict):
        raise TypeError(f"run() returned {type(result).__name__}, expected a dict")
    return result, time.perf_counter() - t0


def run_all(
    quick: bool, only: Sequence[str] | None = None, directory: Path = HERE, peers: bool = False
) -> tuple[dict[str, Any], bool]:
    """Run the modules; return (merged results, whether any module was missing or failed)."""
    present = {p.stem: p for p in sorted(directory.glob("bench_*.py"))}
    stems = [s for s in ORDER if s in EXPECTED] + sorted(set(present) - set(ORDER))
    if not peers:
        stems = [s for s in stems if s not in OPT_IN]
    if not VLLM_PYTHON.exists():
        stems = [s for s in stems if s not in NEEDS_VLLM_VENV]
    if only:
        wanted = {s if s.startswith("bench_") else f"bench_{s}" for s in only}
        stems = [s for s in stems if s in wanted] + sorted(wanted - set(stems))
    owner = {name: stem for stem, names in EXPECTED.items() for name in names}
    merged: dict[str, Any] = {}
    failed = False
    for stem in stems:
        names = EXPECTED.get(stem, (stem,))
        path = present.get(stem)
        if path is None:
            failed = True
            for name in names:
                merged[name] = _error(name, f"benchmarks/{stem}.py is missing")
            print(f"run_all: {stem}: missing", file=sys.stderr)
            continue
        print(f"run_all: {stem} ...", file=sys.stderr, flush=True)
        try:
            result, seconds = run_module(path, quick)
        except BaseException as err:  # a benchmark must never take the others down
            if isinstance(err, KeyboardInterrupt):
                raise
            failed = True
            traceback.print_exc(file=sys.stderr)
            for name in names:
                merged[name] = _error(name, f"{stem}.run() raised {type(err).__name__}: {err}")
            continue
        print(f"run_all: {stem}: {seconds:.1f} s", file=sys.stderr, flush=True)
        for name, entry in result.items():
            problem = _valid(entry)
            if problem is not None:
                failed = True
                entry = _error(name, f"{stem} reported an invalid entry: {problem}")
            else:
                entry = {**entry, "elapsed_s": seconds}
            key = name if owner.get(name, stem) == stem and name not in merged else f"{name}@{stem[6:]}"
            merged[key] = entry
        required = EXPECTED.get(stem) or (() if result else (stem,))
        for name in required:
            if name not in merged:
                failed = True
                merged[name] = _error(name, f"{stem}.run() did not report {name!r}")
    return merged, failed


def table(merged: dict[str, Any]) -> str:
    lines = [f"{'benchmark':<34} {'ratio':>9} {'target':>8}  result"]
    for name, e in merged.items():
        ratio = "-" if e.get("ratio") is None else f"{e['ratio']:.3f}"
        target = "-" if e.get("target") is None else f"{e['target']:.3g}"
        status = f"ERROR: {e['error']}" if "error" in e else ("ok" if e["meets_target"] else "missed")
        lines.append(f"{name:<34} {ratio:>9} {target:>8}  {status}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--only", help="comma-separated modules, e.g. hashing,dispatch (default: all)")
    parser.add_argument("--dir", type=Path, default=HERE, help=argparse.SUPPRESS)
    parser.add_argument("--peers", action="store_true", help="also bench_peers (needs setup-peers.sh)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    merged, failed = run_all(args.quick, only, args.dir, args.peers)
    print(json.dumps(merged, indent=2) if args.json else table(merged))
    missed = any(not e.get("meets_target") for e in merged.values())
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
