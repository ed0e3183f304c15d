"""hicache's file backend beside its peers, same pages, one run (issue 24, "Peer benchmark").

Contenders, each through its own public API at its best settings, each in its own venv
(``benchmarks/setup-peers.sh`` builds the peers' under ``benchmarks/.peers/``):

* hicache ``file`` through ``hicache_core.CacheController`` with a real MHA host pool (K and V,
  half a page each), controller and backend at their defaults: layout ``files`` and, when the
  backend has a ``layout`` option, ``segments``, and ``segments`` with ``fsync: true`` (the
  setting for durable pages: its writes bypass the page cache, as LMCache's and NIXL's
  ``O_DIRECT`` settings do); the ``nixl`` plugin too when it is installed;
* LMCache's ``LocalDiskBackend`` (buffered, its default, and ``use_odirect``);
* SGLang's ``HiCacheFile`` (``batch_set`` / ``batch_get``);
* NIXL's POSIX plugin: default (Linux AIO), ``use_uring``, and ``use_uring`` with ``O_DIRECT``;
* ``raw``: one preallocated file, ``O_DIRECT`` writes and reads at queue depth 1 and at 4, from
  and into huge-page memory as hicache's pools; the row ``raw: one file, O_DIRECT`` is the faster
  depth of each round (``_raw_limit``): the disk's limit, for reference only (it is neither a peer
  nor hicache).

Every round runs every contender once, in a new shuffled order, each in a fresh worker process
(``benchmarks/peers/worker_*.py``) that gets a seed and the case list as JSON on stdin and answers
JSON on stdout. Every worker derives the same pages from the seed and compares every byte it
reads back. Per page size (256 KiB and 2 MiB), per contender: *durable* (the writes, then
``fdatasync`` of every file and ``fsync`` of every directory written, timed together: the same
rule for everyone), *cold* (every file of the contender's root dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` before the timed read) and *warm* (the same read again,
from the page cache). See ``benchmarks/peers/_common.py``.

Figures, per phase: ``file_vs_best_peer_<phase>`` = median GB/s of the best hicache file layout
/ median GB/s of the best peer at any setting, the worst of the two page sizes (targets: cold
>= 1.2, durable >= 1.5, warm >= 1.0). A peer whose venv is missing or whose worker fails is
listed under ``missing`` / ``failed``, never counted as beaten: the ratio then compares only the
peers that ran, and ``meets_target`` is false unless every peer ran (``complete``). With no peer
at all there is no ratio (``null``). A contender that reads a wrong byte fails the run.

Run: ``python benchmarks/bench_peers.py [--quick] [--json] [--rounds N] [--mib M] [--dir DIR]``.
``HICACHE_BENCH_SMOKE=1`` shrinks it to one round of 4 MiB; ``HICACHE_PEERS_DIR`` points at
another directory of peer venvs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "peers"
KIB, MIB = 1024, 1024 * 1024
PAGE_SIZES = (256 * KIB, 2 * MIB)
PHASES = ("durable", "cold", "warm")
TARGETS = {"cold": 1.2, "durable": 1.5, "warm": 1.0}
WORKER_TIMEOUT_S = 900
RAW = "raw: one file, O_DIRECT"  # the faster of the RAW_DEPTHS rows, round by round
RAW_DEPTHS = (1, 4)


@dataclass
class Contender:
    name: str
    kind: str  # "hicache" (the figure's numerator), "peer" (its denominator) or "raw" (reference)
    worker: str
    setting: str
    venv: str | None = None  # a peer venv under the peers directory; None = this interpreter
    missing: str | None = None  # why it cannot run here
    versions: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    gbps: dict[tuple[int, str], list[float]] = field(default_factory=dict)

    def python(self, peers_dir: Path) -> str:
        return sys.executable if self.venv is None else str(peers_dir / self.venv / "bin" / "python")


def peers_dir() -> Path:
    return Path(os.environ.get("HICACHE_PEERS_DIR") or HERE / ".peers")


def _file_layouts() -> list[str]:
    """The file backend's layouts this checkout has (``[""]``: one layout, no option)."""
    try:
        from hicache_file import FileBackend
    except ImportError:
        return []
    field_ = FileBackend.Options.model_fields.get("layout")
    if field_ is None:
        return [""]
    return ["files", "segments"]


def _has_plugin(name: str, dist: str) -> bool:
    """Whether backend ``name`` comes from distribution ``dist`` (not from a stub declaring it)."""
    from importlib.metadata import entry_points

    return any(
        ep.name == name and ep.dist is not None and ep.dist.name == dist
        for ep in entry_points(group="hicache.backends")
    )


def contenders(pdir: Path) -> list[Contender]:
    out: list[Contender] = []
    layouts = _file_layouts()
    if not layouts:
        raise RuntimeError("hicache-file is not installed in this interpreter; run scripts/setup.sh")
    for layout in layouts:
        spec = {"backend": "file", "options": {"layout": layout} if layout else {}}
        out.append(
            Contender(f"hicache file ({layout or 'files'})", "hicache", "worker_hicache.py", json.dumps(spec))
        )
    if "segments" in layouts:  # durable pages: O_DIRECT writes (``direct_io: auto`` with fsync)
        spec = {"backend": "file", "options": {"layout": "segments", "fsync": True}}
        out.append(
            Contender("hicache file (segments, fsync)", "hicache", "worker_hicache.py", json.dumps(spec))
        )
    if _has_plugin("nixl", "hicache-nixl"):  # its best POSIX setting, as for NIXL itself below
        spec = {"backend": "nixl", "options": {"plugin": "posix", "engine": "uring", "o_direct": True}}
        out.append(
            Contender(
                "hicache nixl (io_uring + O_DIRECT)", "hicache-other", "worker_hicache.py", json.dumps(spec)
            )
        )
    out += [
        Contender("LMCache local disk", "peer", "worker_lmcache.py", "buffered", "lmcache"),
        Contender("LMCache local disk, O_DIRECT", "peer", "worker_lmcache.py", "odirect", "lmcache"),
        Contender("SGLang HiCacheFile", "peer", "worker_sglang.py", "default", "sglang"),
        Contender("NIXL POSIX, AIO (default)", "peer", "worker_nixl.py", "aio", "nixl"),
        Contender("NIXL POSIX, io_uring", "peer", "worker_nixl.py", "uring", "nixl"),
        Contender("NIXL POSIX, io_uring + O_DIRECT", "peer", "worker_nixl.py", "odirect", "nixl"),
        *(Contender(f"{RAW}, depth {d}", "raw-depth", "worker_raw.py", str(d)) for d in RAW_DEPTHS),
    ]
    for c in out:
        if c.venv is not None and not os.access(c.python(pdir), os.X_OK):
            c.missing = f"no venv at {pdir / c.venv} (run benchmarks/setup-peers.sh)"
    return out


def _release(root: str) -> None:
    """Free a finished worker's data but keep its inodes until the run ends (see bench_file.py).

    On this machine's ext4 (no journal), unlinking thousands of files slows every file creation
    of the next minute; truncating frees the space without putting that cost on the next
    contender. ``run`` removes the whole tree at the end.
    """
    for d, _, names in os.walk(root):
        for name in names:
            p = os.path.join(d, name)
            try:
                if os.path.isfile(p) and not os.path.islink(p):
                    os.truncate(p, 0)
            except OSError:
                pass


def _run_worker(
    c: Contender, pdir: Path, root: str, seed: int, cases: list[dict[str, int]]
) -> dict[str, Any]:
    req = {"seed": seed, "root": root, "setting": c.setting, "cases": cases}
    try:
        proc = subprocess.run(
            [c.python(pdir), str(WORKERS / c.worker)],
            input=json.dumps(req),
            capture_output=True,
            text=True,
            timeout=WORKER_TIMEOUT_S,
            cwd=str(HERE.parent),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"worker did not answer within {WORKER_TIMEOUT_S} s", "cases": []}
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        tail = proc.stderr.strip().splitlines()[-5:]
        return {
            "error": f"worker exited {proc.returncode} without an answer: {' | '.join(tail)}",
            "cases": [],
        }


def _round(
    cs: list[Contender], pdir: Path, base: str, rnd: int, pages: dict[int, int], rng: random.Random
) -> None:
    order = [c for c in cs if c.missing is None]
    rng.shuffle(order)
    seed = rng.randrange(1 << 30)
    for i, c in enumerate(order):
        sizes = list(PAGE_SIZES)
        rng.shuffle(sizes)
        root = os.path.join(base, f"r{rnd:02d}-{i:02d}")
        os.makedirs(root)
        try:
            ans = _run_worker(c, pdir, root, seed, [{"page_bytes": s, "pages": pages[s]} for s in sizes])
        finally:
            _release(root)
        c.versions = ans.get("versions") or c.versions
        if ans.get("error"):
            c.errors.append(str(ans["error"]))
        for case in ans.get("cases", []):
            if case.get("error"):
                c.errors.append(f"{case['page_bytes'] // KIB} KiB: {case['error']}")
                if case.get("wrong_pages"):
                    raise RuntimeError(
                        f"{c.name} read {case['wrong_pages']} pages with wrong bytes: {case['error']}"
                    )
                continue
            for ph in PHASES:
                c.gbps.setdefault((case["page_bytes"], ph), []).append(case["bytes"] / case[f"{ph}_s"] / 1e9)


def _raw_limit(cs: list[Contender]) -> Contender:
    """The ``raw`` row: per round, size and phase, the faster of the depth rows (as
    ``bench_file.raw_limit`` takes the faster of depth 1 and 4)."""
    rows = [c for c in cs if c.kind == "raw-depth"]
    out = Contender(RAW, "raw", "worker_raw.py", "+".join(c.setting for c in rows))
    out.missing = next((c.missing for c in rows if c.missing), None)
    out.errors = [e for c in rows for e in c.errors]
    out.versions = next((c.versions for c in rows if c.versions), {})
    for key in {k for c in rows for k in c.gbps}:
        runs = [c.gbps.get(key, []) for c in rows]
        if all(runs):
            out.gbps[key] = [max(v) for v in zip(*runs)]
    return out


def _median(c: Contender, size: int, phase: str) -> float | None:
    v = c.gbps.get((size, phase))
    return statistics.median(v) if v else None


def _figures(cs: list[Contender], rounds: int) -> dict[str, Any]:
    ran = [c for c in cs if c.missing is None and not c.errors]
    peers_all = [c for c in cs if c.kind == "peer"]
    missing = {c.name: c.missing for c in peers_all if c.missing is not None}
    failed = {c.name: c.errors[0] for c in peers_all if c.missing is None and c.errors}
    complete = not missing and not failed
    table = {
        c.name: {
            "kind": c.kind,
            "setting": c.setting,
            "versions": c.versions,
            **({"missing": c.missing} if c.missing else {}),
            **({"errors": c.errors} if c.errors else {}),
            **{
                f"{size // KIB}KiB_{ph}_gbps": (
                    round(m, 3) if (m := _median(c, size, ph)) is not None else None
                )
                for size in PAGE_SIZES
                for ph in PHASES
            },
            "rounds_gbps": {
                f"{size // KIB}KiB_{ph}": [round(x, 3) for x in c.gbps.get((size, ph), [])]
                for size in PAGE_SIZES
                for ph in PHASES
            },
        }
        for c in cs
    }
    out: dict[str, Any] = {}
    for ph in PHASES:
        per_size = {}
        for size in PAGE_SIZES:
            mine = [
                (m, c.name) for c in ran if c.kind == "hicache" and (m := _median(c, size, ph)) is not None
            ]
            theirs = [
                (m, c.name) for c in ran if c.kind == "peer" and (m := _median(c, size, ph)) is not None
            ]
            if not mine:
                why = {c.name: c.missing or c.errors for c in cs if c.kind == "hicache"}
                raise RuntimeError(f"no hicache file layout completed {size // KIB} KiB {ph}: {why}")
            best_mine, best_theirs = max(mine), (max(theirs) if theirs else None)
            per_size[f"{size // KIB}KiB"] = {
                "hicache": best_mine[1],
                "hicache_gbps": round(best_mine[0], 3),
                "best_peer": best_theirs[1] if best_theirs else None,
                "best_peer_gbps": round(best_theirs[0], 3) if best_theirs else None,
                "ratio": round(best_mine[0] / best_theirs[0], 3) if best_theirs else None,
            }
        ratios = [v["ratio"] for v in per_size.values() if v["ratio"] is not None]
        ratio = min(ratios) if len(ratios) == len(per_size) else None
        out[f"file_vs_best_peer_{ph}"] = {
            "ratio": ratio,
            "target": TARGETS[ph],
            "meets_target": bool(complete and ratio is not None and ratio >= TARGETS[ph]),
            "complete": complete,
            "missing": missing,
            "failed": failed,
            "hicache_failed": {c.name: c.errors[0] for c in cs if c.kind.startswith("hicache") and c.errors},
            "per_size": per_size,
            "rounds": rounds,
            "table": table,
        }
    return out


def run(
    quick: bool = False, base: str | None = None, rounds: int | None = None, mib: int | None = None
) -> dict[str, Any]:
    smoke = os.environ.get("HICACHE_BENCH_SMOKE", "") not in ("", "0")
    rounds = rounds or (1 if smoke else 3 if quick else 9)
    mib = mib or (4 if smoke else 64 if quick else 512)
    pages = {s: max(1, mib * MIB // s) for s in PAGE_SIZES}
    pdir = peers_dir()
    cs = contenders(pdir)
    for c in cs:
        if c.missing:
            print(f"bench_peers: {c.name}: MISSING ({c.missing})", file=sys.stderr, flush=True)
    tmp = tempfile.mkdtemp(prefix="hicache-peers-", dir=base)
    rng = random.Random(time.time_ns())
    try:
        for rnd in range(rounds):
            t0 = time.perf_counter()
            _round(cs, pdir, tmp, rnd, pages, rng)
            print(
                f"bench_peers: round {rnd + 1}/{rounds}: {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = _figures([*cs, _raw_limit(cs)], rounds)
    for c in cs:
        if c.errors:
            print(f"bench_peers: {c.name}: FAILED ({c.errors[0]})", file=sys.stderr, flush=True)
    print(
        "bench_peers: versions: " + "; ".join(f"{c.name}: {c.versions}" for c in cs if c.versions),
        file=sys.stderr,
        flush=True,
    )
    for r in res.values():
        r["mib_per_size"] = mib
    return res


def table(res: dict[str, Any]) -> str:
    any_fig = next(iter(res.values()))
    lines = [
        f"{'contender':<34}" + "".join(f"{f'{s // KIB}K {ph}':>13}" for s in PAGE_SIZES for ph in PHASES)
    ]
    for name, row in any_fig["table"].items():
        if "missing" in row:
            lines.append(f"{name:<34}  MISSING: {row['missing']}")
            continue
        cells = "".join(
            f"{('-' if (v := row[f'{s // KIB}KiB_{ph}_gbps']) is None else f'{v:.2f}'):>13}"
            for s in PAGE_SIZES
            for ph in PHASES
        )
        lines.append(f"{name:<34}{cells}" + ("  FAILED" if "errors" in row else ""))
    lines.append("(GB/s, median over rounds)")
    for name, fig in res.items():
        r = "-" if fig["ratio"] is None else f"{fig['ratio']:.3f}"
        status = (
            "ok"
            if fig["meets_target"]
            else ("missed" if fig["complete"] else "incomplete (peers missing/failed)")
        )
        lines.append(f"{name:<28} {r:>7}  target {fig['target']}  {status}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 64 MiB per page size")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, help="rounds (default 9, --quick 3)")
    parser.add_argument("--mib", type=int, help="MiB per page size and round (default 512, --quick 64)")
    parser.add_argument("--dir", help="where the stores go (default: the system temp dir)")
    args = parser.parse_args(argv)
    res = run(args.quick, args.dir, args.rounds, args.mib)
    print(json.dumps(res, indent=2) if args.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
