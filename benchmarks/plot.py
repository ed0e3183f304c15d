"""Plot the scaling sweep (``bench_scaling.py --out FILE`` or ``run_all.py --json`` output) to a PNG.

Two panels (backup, prefetch): GB/s against batch size (pages, log scale), one line per backend
and I/O thread count, so the knee of each curve and the effect of threads are visible.

Run: ``python benchmarks/plot.py scaling.json -o scaling.png`` (``-`` reads stdin). Needs
matplotlib (``.venv/bin/pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


def points_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep points of a bench_scaling (or run_all) result."""
    entry = data.get("scaling_default_vs_best", data)
    points = entry.get("points") if isinstance(entry, dict) else None
    if not points:
        raise SystemExit("plot.py: no scaling points in the input (expected bench_scaling.py --json output)")
    return list(points)


def plot(points: list[dict[str, Any]], out: str, title: str = "hicache scaling") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    series: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for p in points:
        series.setdefault((p["backend"], p["threads"]), []).append(p)
    styles = ["-", "--", ":", "-."]
    backends = sorted({b for b, _ in series})
    for ax, metric, label in zip(axes, ("backup_gbps", "prefetch_gbps"), ("backup", "prefetch")):
        for (backend, threads), pts in sorted(series.items()):
            pts = sorted(pts, key=lambda p: p["batch_pages"])
            ax.plot(
                [p["batch_pages"] for p in pts],
                [p[metric] for p in pts],
                styles[backends.index(backend) % len(styles)],
                marker="o",
                label=f"{backend}, {threads} thread(s)",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (pages)")
        ax.set_ylabel("GB/s")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    page_kib = points[0]["page_bytes"] // 1024
    fig.suptitle(f"{title} ({page_kib} KiB pages, {points[0]['pages']} pages per phase)")
    axes[1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input", help="JSON file from bench_scaling.py --out / --json, or - for stdin")
    parser.add_argument("-o", "--output", default="scaling.png", help="PNG to write (default scaling.png)")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.input == "-" else open(args.input).read()
    plot(points_of(json.loads(text)), args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
