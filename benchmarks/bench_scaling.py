"""Scaling: throughput vs batch size (1..1024 pages) and vs I/O threads (1, 2, 4).

For each backend (``file``; ``mooncake`` too when its plugin and ``mooncake_master`` are
installed, on a master this benchmark starts on loopback), the sweep's points are (batch size
B, threads T): a controller with ``batch_pages=B`` and ``io_threads=T`` (and the backend's own
``io_threads`` option set to T where it has one, e.g. file's per-batch parallelism), plus the
**default** point: a controller and store built with no controller setting and no backend
option given, i.e. what a user gets. One measurement of a point backs up ``pages`` pages (MHA
``page_first``, 64 KiB per page, two 32 KiB components) in requests of B pages with
``backup_async`` (fresh keys), then prefetches them with ``prefetch_async``, so up to T
batches are in flight; GB/s of each phase and of both (bytes moved twice / total time).

Method (what makes the headline hold still on a shared VM):

* each distinct store (backend options) is opened ONCE, warmed with an untimed backup +
  prefetch + clear of the same volume, and shared by the controllers of every point that uses
  it; the store is cleared after each measurement (untimed). Opening a store per point made
  every backup pay first-touch costs (a fresh Mooncake segment, new ext4 directories) that
  have nothing to do with B or T;
* selection: rounds over the whole grid (3), each in its own shuffled order, so drifts of the
  machine and of the file system hit every point alike; the best point is the one with the
  highest median combined throughput over those rounds;
* measurement: then the default and the best point are measured back to back (15 pairs in
  ``--quick``, 21 in the full run, in alternating order) on fresh samples. The headline ``scaling_default_vs_best`` is, per backend,
  the MEDIAN of those pairs' default / best combined throughput, and the worst backend is
  reported (target >= 0.8: the defaults leave at most 20% on the table). Reusing the selection
  rounds for the ratio would favour the best point twice: picked as the maximum of nine noisy
  medians, its median is biased upwards even when every point is equally fast.

Run: ``python benchmarks/bench_scaling.py [--quick] [--json] [--out FILE]``; plot with
``python benchmarks/plot.py FILE -o scaling.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from hicache_core import CacheController, MHAKVPool, StorageConfig, find_backends, open_store, page_hashes

TARGET = 0.8
LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 16, 2, 64, 8  # bf16: 32 KiB per component, 64 KiB per page
THREADS = (1, 2, 4)
SMOKE = os.environ.get("HICACHE_BENCH_SMOKE", "") not in ("", "0")
DEFAULT = "default"


def _grid(quick: bool) -> tuple[int, tuple[int, ...], tuple[int, ...], int, int]:
    """(pages, batch sizes, thread counts, selection rounds, default / best pairs) of the sweep."""
    if SMOKE:  # tests: only prove it runs and reports
        return 128, (16, 128), (1, 2), 1, 1
    if quick:
        return 256, (1, 16, 128), THREADS, 3, 15
    return 1024, (1, 4, 16, 64, 128, 256, 1024), THREADS, 3, 21


def _options_field(backend: str, name: str) -> bool:
    from hicache_core import load_backend_class

    return name in load_backend_class(backend).Options.model_fields  # type: ignore[attr-defined]


class _Point:
    """One point of the sweep: a controller over a shared store, its pool and its requests."""

    def __init__(
        self, store: Any, pool: MHAKVPool, backend: str, batch: int | None, threads: int | None
    ) -> None:
        settings = {} if batch is None else {"batch_pages": batch, "io_threads": threads}
        config = StorageConfig(
            backend=backend, options=store.config.options, model_name="scaling", **settings
        )
        self.pool = pool  # the store's one pool: a backend serves the pool registered last under a name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.ctl = CacheController(config, pool, store=store)
        self.store = store
        self.pages = pool.num_pages
        self.batch = self.ctl.settings.batch_pages
        self.threads = self.ctl.settings.io_threads
        self.label = DEFAULT if batch is None else f"b{batch}-t{threads}"

    def measure(self) -> tuple[float, float]:
        """(backup s, prefetch s) of every page, on fresh keys; the store is cleared afterwards."""
        pages, batch, ctl = self.pages, self.batch, self.ctl
        tokens = torch.randint(0, 150_000, (pages * PAGE_TOKENS,), dtype=torch.int32)
        hashes = page_hashes(tokens, PAGE_TOKENS)
        reqs = [
            (hashes[s : s + batch], list(range(s, min(s + batch, pages)))) for s in range(0, pages, batch)
        ]

        def phase(op: str) -> float:
            t0 = time.perf_counter()
            futs: list[Future[Any]] = [
                ctl.backup_async(h, idx) if op == "backup" else ctl.prefetch_async(h, idx).future
                for h, idx in reqs
            ]
            done = sum(f.result().pages for f in futs)
            elapsed = time.perf_counter() - t0
            if done != pages:
                raise RuntimeError(f"{self.store.name} {op}: {done} of {pages} pages ({self.label})")
            return elapsed

        try:
            return phase("backup"), phase("prefetch")
        finally:
            self.store.clear()

    def close(self) -> None:
        self.ctl.close()


def sweep(
    rounds: int, pairs: int, backend: str, options: dict[str, Any], pages: int, grid: list[tuple[int, int]]
) -> dict[str, Any]:
    """Measure the default point and every (batch, threads) point once per round, pick the best
    point from those rounds, then measure ``pairs`` fresh default / best pairs (see the module
    docstring); return the points (medians over the rounds) and the median paired ratio."""
    has_threads = _options_field(backend, "io_threads")
    stores: dict[Any, Any] = {}
    points: list[_Point] = []
    try:
        for key, opts in (
            [(DEFAULT, dict(options))]
            + [(t, {**options, "io_threads": t}) for t in sorted({t for _, t in grid})]
            if has_threads
            else [(DEFAULT, dict(options))]
        ):
            stores[key] = open_store(StorageConfig(backend=backend, options=opts, model_name="scaling"))
        pools = {}
        for key in stores:
            pools[key] = MHAKVPool(
                pages, PAGE_TOKENS, LAYERS, HEADS, HEAD_DIM, torch.bfloat16, allocate=False
            )
        points.append(_Point(stores[DEFAULT], pools[DEFAULT], backend, None, None))
        for batch, threads in grid:
            key = threads if has_threads else DEFAULT
            points.append(_Point(stores[key], pools[key], backend, batch, threads))
        for pool in pools.values():
            for b in pool.buffers():
                b.random_(0, 256)
        warmed: set[int] = set()
        for p in points:  # warm every store once, untimed
            if id(p.store) not in warmed:
                warmed.add(id(p.store))
                p.measure()
        times: dict[str, list[tuple[float, float]]] = {p.label: [] for p in points}
        rng = random.Random(12345)
        for _ in range(rounds):  # selection: every point once per round, in a shuffled order
            for p in rng.sample(points, len(points)):
                times[p.label].append(p.measure())
        best = max(points, key=lambda p: statistics.median(_combined(p, t) for t in times[p.label]))
        paired = []
        for i in range(pairs):  # measurement: the default and the best back to back, fresh samples
            pair = (points[0], best) if i % 2 == 0 else (best, points[0])
            got = {q.label: _combined(q, q.measure()) for q in pair}
            paired.append(got[DEFAULT] / got[best.label])
    finally:
        for p in points:
            p.close()
        for st in stores.values():
            st.close()
    nbytes = pages * points[0].pool.page_nbytes
    out = []
    for p in points:
        t = times[p.label]
        out.append(
            {
                "backend": backend,
                "point": p.label,
                "batch_pages": p.batch,
                "threads": p.threads,
                "pages": pages,
                "page_bytes": p.pool.page_nbytes,
                "rounds": rounds,
                "backup_gbps": nbytes / statistics.median(b for b, _ in t) / 1e9,
                "prefetch_gbps": nbytes / statistics.median(f for _, f in t) / 1e9,
                "combined_gbps": statistics.median(_combined(p, x) for x in t),
            }
        )
    return {
        "points": out[1:],  # the grid (plot.py draws it); the default point is reported apart
        "ratio": statistics.median(paired),
        "ratio_per_pair": paired,
        "best": {"point": best.label, "batch_pages": best.batch, "threads": best.threads},
        "default": out[0],
    }


def _combined(point: _Point, times: tuple[float, float]) -> float:
    """GB/s of a backup + prefetch measurement (bytes moved twice / total time)."""
    return 2 * point.pages * point.pool.page_nbytes / sum(times) / 1e9


@contextlib.contextmanager
def _file_options() -> Iterator[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix="hicache-scaling-")
    try:
        yield {"root": root}
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _mooncake_options() -> Iterator[dict[str, Any]]:
    from hicache_mooncake.testing import MooncakeMaster  # type: ignore[import-not-found]

    with MooncakeMaster() as master:
        yield {
            "master_server_address": master.address,
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "global_segment_size": 512 << 20,
        }


def available_backends() -> dict[str, Any]:
    """Backends to sweep, each with a context manager yielding its options."""
    out: dict[str, Any] = {}
    names = find_backends()
    if "file" in names:
        out["file"] = _file_options
    if "mooncake" in names:
        try:
            from hicache_mooncake.testing import find_mooncake_binary

            find_mooncake_binary("mooncake_master")
            out["mooncake"] = _mooncake_options
        except Exception as err:  # plugin or binary missing: sweep what exists
            print(f"bench_scaling: skipping mooncake ({type(err).__name__}: {err})", file=sys.stderr)
    return out


def run(quick: bool = False) -> dict[str, Any]:
    """Return ``{"scaling_default_vs_best": {...}}`` with every point of the sweep."""
    pages, batches, threads, rounds, pairs = _grid(quick)
    points: list[dict[str, Any]] = []
    per: dict[str, dict[str, Any]] = {}
    for backend, options_cm in available_backends().items():
        with options_cm() as options:
            grid = [(b, t) for b in batches for t in threads]
            per[backend] = sweep(rounds, pairs, backend, options, pages, grid)
        points += [per[backend]["default"], *per[backend]["points"]]
    if not per:
        raise RuntimeError("bench_scaling: no backend to measure (install plugins/file)")
    worst = min(per, key=lambda b: per[b]["ratio"])
    return {
        "scaling_default_vs_best": {
            "ratio": per[worst]["ratio"],
            "target": TARGET,
            "meets_target": per[worst]["ratio"] >= TARGET,
            "backend": worst,
            "per_backend": {b: r["ratio"] for b, r in per.items()},
            "ratio_per_pair": {b: r["ratio_per_pair"] for b, r in per.items()},
            "default": {b: r["default"] for b, r in per.items()},
            "best": {b: r["best"] for b, r in per.items()},
            "points": [p for p in points if p["point"] != DEFAULT],
            "default_points": [p for p in points if p["point"] == DEFAULT],
        }
    }


def table(result: dict[str, Any]) -> str:
    r = result["scaling_default_vs_best"]
    lines = [
        f"{'backend':<9} {'point':>8} {'batch':>6} {'threads':>7} {'backup GB/s':>12} {'prefetch GB/s':>14} "
        f"{'both GB/s':>10}  (medians over rounds)"
    ]
    for p in [*r["default_points"], *r["points"]]:
        lines.append(
            f"{p['backend']:<9} {p['point']:>8} {p['batch_pages']:>6} {p['threads']:>7} {p['backup_gbps']:>12.3f} "
            f"{p['prefetch_gbps']:>14.3f} {p['combined_gbps']:>10.3f}"
        )
    per = ", ".join(
        f"{b} {v:.2f} (default B={r['default'][b]['batch_pages']} T={r['default'][b]['threads']}, best "
        f"{r['best'][b]['point']})"
        for b, v in r["per_backend"].items()
    )
    lines.append(
        f"scaling_default_vs_best (median paired default / best): {per}; worst {r['ratio']:.2f} "
        f"(target >= {r['target']}) -> {'OK' if r['meets_target'] else 'MISSED'}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sweep")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", help="also write the JSON result to this file (input of plot.py)")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(json.dumps(result, indent=2) if args.json else table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
