"""Cold start: ``hicache backends`` and ``import hicache_core`` vs ``python -c pass``.

Each command runs as a fresh process with the same interpreter (``sys.executable``), several
times, round-robin so background load hits all of them alike; min and median wall times are
reported. ``cold_start_vs_python``: ratio = the slower of ``hicache backends`` and ``import
hicache_core`` (median) / ``python -c pass`` (median); target: within 0.3 s of the bare
interpreter, expressed as the ratio ``(pass + 0.3 s) / pass`` of this run; ``meets_target``
also requires the listing check below to pass.

It also checks, in a fresh process, that *listing* (``hicache_core.find_backends()``) imports no
plugin module and not torch, and that loading one backend imports that plugin only.

Run: ``python benchmarks/bench_cold_start.py [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

BUDGET_S = 0.3
SMOKE = os.environ.get("HICACHE_BENCH_SMOKE", "") not in ("", "0")

_LISTING_PROBE = r"""
import json, sys
import hicache_core
from hicache_core.plugin.registry import find_backends
before = set(sys.modules)
infos = find_backends()
plugin_modules = sorted({i.value.split(":")[0].split(".")[0] for i in infos.values()})
listed = [m for m in plugin_modules if m in sys.modules]
out = {"backends": sorted(infos), "imported_by_listing": listed, "torch_by_listing": "torch" in sys.modules}
if infos:
    chosen = "file" if "file" in infos else sorted(infos)[0]
    try:
        hicache_core.load_backend_class(chosen)
        out["selected"] = chosen
        out["imported_after_select"] = [m for m in plugin_modules if m in sys.modules]
    except Exception as err:  # an unavailable plugin is fine here
        out["selected"] = chosen
        out["select_error"] = f"{type(err).__name__}: {err}"
        out["imported_after_select"] = [m for m in plugin_modules if m in sys.modules]
    out["selected_module"] = infos[chosen].value.split(":")[0].split(".")[0]
print(json.dumps(out))
"""


def _hicache_cmd() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "hicache")
    if os.path.exists(script):
        return [script]
    found = shutil.which("hicache")
    return [found] if found else [sys.executable, "-m", "hicache_core.cli"]


def commands() -> dict[str, list[str]]:
    py = sys.executable
    return {
        "python -c pass": [py, "-c", "pass"],
        "import hicache_core": [py, "-c", "import hicache_core"],
        "hicache backends": [*_hicache_cmd(), "backends", "--json"],
    }


def _wall(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - t0


def _warm_env() -> dict[str, str]:
    """The environment for the warm-up run: bytecode caches may be written.

    ``pip install`` byte-compiles a regular install; an editable one (and a shell with
    ``PYTHONDONTWRITEBYTECODE`` set) would otherwise recompile every module on every start and
    measure the compiler, not hicache's start-up."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def listing_check() -> dict[str, Any]:
    """What listing and selecting import, measured in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _LISTING_PROBE], capture_output=True, text=True, check=True)
    out: dict[str, Any] = json.loads(proc.stdout)
    selected = out.get("selected_module")
    out["listing_is_lazy"] = not out["imported_by_listing"] and not out["torch_by_listing"]
    out["select_imports_only_selected"] = all(m == selected for m in out.get("imported_after_select", []))
    return out


def run(quick: bool = False) -> dict[str, Any]:
    """Return ``{"cold_start_vs_python": {...}}`` with per-command min/median seconds."""
    cmds = commands()
    runs = 1 if SMOKE else 5 if quick else 10
    if not SMOKE:
        warm = _warm_env()
        for cmd in cmds.values():  # warm the page cache and the bytecode caches once
            _wall(cmd, warm)
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(runs):
        for name, cmd in cmds.items():
            times[name].append(_wall(cmd))
    stats = {n: {"min_s": min(t), "median_s": statistics.median(t), "runs": len(t)} for n, t in times.items()}
    base = stats["python -c pass"]["median_s"]
    worst_name = max(("import hicache_core", "hicache backends"), key=lambda n: stats[n]["median_s"])
    worst = stats[worst_name]["median_s"]
    listing = listing_check()
    return {
        "cold_start_vs_python": {
            "ratio": worst / base,
            "target": (base + BUDGET_S) / base,
            "meets_target": worst - base <= BUDGET_S
            and listing["listing_is_lazy"]
            and listing["select_imports_only_selected"],
            "extra_s": worst - base,
            "budget_s": BUDGET_S,
            "slowest": worst_name,
            "commands": stats,
            "listing": listing,
        }
    }


def table(result: dict[str, Any]) -> str:
    r = result["cold_start_vs_python"]
    lines = [f"{'command':<22} {'min s':>8} {'median s':>9}"]
    for name, s in r["commands"].items():
        lines.append(f"{name:<22} {s['min_s']:>8.3f} {s['median_s']:>9.3f}")
    lst = r["listing"]
    lines.append(
        f"listing imports plugins: {lst['imported_by_listing'] or 'none'}; torch: {lst['torch_by_listing']}; "
        f"selecting {lst.get('selected', '-')!r} imports {lst.get('imported_after_select', [])}"
    )
    lines.append(
        f"cold_start_vs_python: {r['slowest']} +{r['extra_s']:.3f} s over python (budget {r['budget_s']} s); "
        f"ratio {r['ratio']:.2f} (target <= {r['target']:.2f}) -> {'OK' if r['meets_target'] else 'MISSED'}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
