"""Mooncake plugin vs the raw Mooncake client, on the same pages, in the same run.

For each mode (embedded ``setup``; standalone ``setup_dummy`` against a real ``mooncake_client``)
and page size, one MLA-style KV pool (one object per page) is attached through the
``CacheController``. Each repetition, on fresh page hashes:

* plugin: ``backup`` (zero-copy v2 put; no existence pass, since the plugin declares
  ``set_skips_existing``) and ``prefetch`` (zero-copy v2 get, stopping at the first miss) of
  every page;
* raw: ``batch_put_from`` then ``batch_get_into`` on the SAME registered pages, with the same
  number of keys per call, through the same ``MooncakeDistributedStore`` instance. Like an
  engine that calls the client itself (SGLang's ``MooncakeStore`` does), each call derives its
  keys from the page hashes (``f"{hash}_{rank}_k"``) and its addresses and sizes from the host
  pages inside the timed region; that costs about 1.5% at 256 KiB pages.

A third variant times the plugin's v2 hook alone (``Store.batch_io_v2`` SET then GET, keys
resolved beforehand) to separate the plugin's own cost from the CacheController's (existence
checks, planning, key building). Bytes are verified after every timed prefetch / get.

GB/s = 1e9 bytes per second; the combined figure is ``2 * bytes / (t_write + t_read)``. Every
repetition times the variants back to back: plugin and raw adjacent, in alternating order, and
the hooks variant at one end. The ratio is the median over repetitions of that repetition's
raw time / plugin time (a paired estimate: the load drifts of a shared machine hit both sides
of a pair alike, and the median ignores the outlier repetitions). The tables' GB/s are the best
(minimum-time) repetition of each step, and ``ratio_best`` / ``ratio_median`` report the ratio
of those bests and of the per-variant medians for comparison. The headline ratio is the worst
case over page sizes >= 256 KiB (target 0.95); 16 KiB is reported too.

Usage: ``python benchmarks/bench_mooncake.py [--quick] [--json]``. It starts (and stops) its own
``mooncake_master`` and ``mooncake_client`` on free loopback ports.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
TARGET = 0.95
KIB = 1 << 10
MIB = 1 << 20


def _hashes(n: int) -> list[str]:
    from hicache_core import page_hashes

    return page_hashes([hash((uuid.uuid4().int, i)) & 0x7FFFFFFF for i in range(n)], 1)


def _bench_case(
    opts: dict[str, Any], page_bytes: int, total: int, reps: int, chunk: int, segment: int
) -> dict[str, Any]:
    import torch

    from hicache_core import CacheController, IoOp, MLAKVPool, PoolName, PoolTransfer, StorageConfig

    n = total // page_bytes
    cfg = StorageConfig(
        backend="mooncake",
        options=opts,
        model_name=f"bench-{page_bytes}",
        is_mla_model=True,
        kv_dtype="uint8",
        controller={"batch_pages": chunk},
    )
    pool = MLAKVPool(n, 1, 1, page_bytes, torch.uint8, allocate=False)
    with CacheController(cfg, pool) as ctl:
        store = ctl.store
        backend: Any = store.backend
        raw = backend.link.store  # the very MooncakeDistributedStore the plugin uses
        buf = pool.buffers()[0]
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
        ref = buf.clone()
        idx = list(range(n))
        base = buf.data_ptr()
        spans = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]

        def raw_call(hashes: list[str]) -> tuple[list[str], list[int], list[int]]:
            # What an engine calling the client itself does per call (SGLang's MooncakeStore
            # does): derive the keys from the page hashes and the addresses from the host pages.
            keys = [f"{h}_0_k" for h in hashes]
            return keys, [base + i * page_bytes for i in idx], [page_bytes] * len(keys)

        def raw_put(hashes: list[str]) -> None:
            keys, ptrs, sizes = raw_call(hashes)
            for a, b in spans:
                res = raw.batch_put_from(keys[a:b], ptrs[a:b], sizes[a:b])
                assert all(r == 0 for r in res), set(res)

        def raw_get(hashes: list[str]) -> None:
            keys, ptrs, sizes = raw_call(hashes)
            for a, b in spans:
                res = raw.batch_get_into(keys[a:b], ptrs[a:b], sizes[a:b])
                assert all(r == page_bytes for r in res), set(res)

        def timed(fn: Callable[[], T]) -> tuple[T, float]:
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0

        def check(what: str) -> None:
            assert torch.equal(buf, ref), f"{what}: bytes differ"

        def run_plugin() -> tuple[float, float]:
            hashes = _hashes(n)
            wrote, tw = timed(lambda: ctl.backup(hashes, idx))
            buf.zero_()
            read, tr = timed(lambda: ctl.prefetch(hashes, idx))
            assert wrote.ok and wrote.pages == n and read.pages == n, (wrote, read)
            check("plugin prefetch")
            return tw, tr

        def run_hooks() -> tuple[float, float]:
            hashes = _hashes(n)
            transfers = [
                PoolTransfer(
                    PoolName.KV,
                    tuple(idx[a:b]),
                    tuple(hashes[a:b]),
                    keys=tuple(store.page_keys("kv", hashes[a:b])),
                )
                for a, b in spans
            ]
            wrote, tw = timed(lambda: [store.batch_io_v2(IoOp.SET, [t])[0] for t in transfers])
            buf.zero_()
            read, tr = timed(lambda: [store.batch_io_v2(IoOp.GET, [t])[0] for t in transfers])
            assert all(all(flags) for flags in (*wrote, *read)), "plugin v2 hook reported failures"
            check("plugin v2 get")
            return tw, tr

        def run_raw() -> tuple[float, float]:
            hashes = _hashes(n)
            _, tw = timed(lambda: raw_put(hashes))
            buf.zero_()
            _, tr = timed(lambda: raw_get(hashes))
            check("raw get")
            return tw, tr

        # warm up (not timed): fault in the WHOLE store segment once, and every code path
        for _ in range(max(1, int(0.8 * segment) // total)):
            raw_put(_hashes(n))
        raw.remove_all(True)
        runs = {"plugin": run_plugin, "hooks": run_hooks, "raw": run_raw}
        for fn in runs.values():
            fn()
            raw.remove_all(True)
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        for rep in range(reps):
            # plugin and raw always back to back (the pair the headline ratio compares), in
            # alternating order to cancel order effects; the diagnostic hooks variant at an end
            order = ["plugin", "raw", "hooks"] if rep % 2 == 0 else ["hooks", "raw", "plugin"]
            for name in order:
                results[name].append(runs[name]())
                raw.remove_all(True)

    def best(name: str, i: int) -> float:
        return min(r[i] for r in results[name])

    def med(name: str, i: int) -> float:
        return statistics.median(r[i] for r in results[name])

    def gbps(seconds: float) -> float:
        return round(total / seconds / 1e9, 3)

    def both(stat: Callable[[str, int], float], name: str) -> float:
        return 2 * total / (stat(name, 0) + stat(name, 1)) / 1e9

    # Paired estimate: each rep times every variant back to back (alternating order), so the
    # per-rep ratio cancels the load drifts of a shared machine; its median ignores outlier reps.
    per_rep = [sum(r) / sum(p) for r, p in zip(results["raw"], results["plugin"])]
    hook_rep = [sum(r) / sum(h) for r, h in zip(results["raw"], results["hooks"])]
    return {
        "page_bytes": page_bytes,
        "pages": n,
        "total_bytes": total,
        "keys_per_call": chunk,
        "reps": reps,
        "plugin_backup_gbps": gbps(best("plugin", 0)),
        "plugin_prefetch_gbps": gbps(best("plugin", 1)),
        "raw_put_gbps": gbps(best("raw", 0)),
        "raw_get_gbps": gbps(best("raw", 1)),
        "plugin_gbps": round(both(best, "plugin"), 3),
        "raw_gbps": round(both(best, "raw"), 3),
        "ratio": round(statistics.median(per_rep), 4),
        "ratio_best": round(both(best, "plugin") / both(best, "raw"), 4),
        "ratio_median": round(both(med, "plugin") / both(med, "raw"), 4),
        "ratio_per_rep": [round(r, 4) for r in per_rep],
        "hook_set_gbps": gbps(best("hooks", 0)),
        "hook_get_gbps": gbps(best("hooks", 1)),
        "hook_ratio": round(statistics.median(hook_rep), 4),
    }


def run(quick: bool) -> dict[str, Any]:
    """Run the benchmark; return ``{"mooncake_vs_raw_client": {...}}``."""
    import torch
    from hicache_mooncake.testing import MooncakeMaster, MooncakeStandalone

    torch.set_num_threads(1)
    logging.getLogger("hicache").setLevel(logging.ERROR)
    total = 64 * MIB if quick else 256 * MIB
    # Per-rep ratios spread 0.6-1.35 on this shared VM (interquartile range ~0.16, raw against
    # raw alike): the median of 101 reps still moved by +-0.02 between runs, so the headline
    # (>= 256 KiB) cases of a quick run take 201 reps (~30 s more per mode); 16 KiB is reported
    # only, and a full rep moves 4x the bytes.
    reps_small = 41
    reps_big = 201 if quick else 41
    pages = [16 * KIB, 256 * KIB] if quick else [16 * KIB, 256 * KIB, 2 * MIB]
    chunk = 1024
    cases: list[dict[str, Any]] = []
    seg_bytes = max(512 * MIB, 4 * total)
    seg = f"{seg_bytes // MIB}MB"
    with MooncakeMaster() as master:
        opts = {
            "master_server_address": master.address,
            "local_hostname": "127.0.0.1",
            "global_segment_size": seg,
            "load_env": False,
        }
        for pb in pages:
            reps = reps_big if pb >= 256 * KIB else reps_small
            cases.append({"mode": "embedded", **_bench_case(opts, pb, total, reps, chunk, seg_bytes)})
    with MooncakeStandalone(global_segment_size=seg) as cluster:
        opts = cluster.options(load_env=False)
        for pb in pages:
            reps = reps_big if pb >= 256 * KIB else reps_small
            cases.append({"mode": "standalone", **_bench_case(opts, pb, total, reps, chunk, seg_bytes)})
    big = [c["ratio"] for c in cases if c["page_bytes"] >= 256 * KIB]
    small = [c["ratio"] for c in cases if c["page_bytes"] < 256 * KIB]
    ratio = min(big)
    hook_big = [c["hook_ratio"] for c in cases if c["page_bytes"] >= 256 * KIB]
    return {
        "mooncake_vs_raw_client": {
            "ratio": ratio,
            "target": TARGET,
            "meets_target": ratio >= TARGET,
            "ratio_definition": "min over modes and page sizes >= 256 KiB of the median over reps of "
            "raw time / plugin time (backup+prefetch vs batch_put_from+batch_get_into, run back to back)",
            "ratio_16kib_min": min(small) if small else None,
            "hook_ratio": min(hook_big),
            "hook_ratio_definition": "the same with the plugin's v2 hook alone (Store.batch_io_v2 SET + GET, "
            "keys resolved beforehand): the plugin's own cost without the CacheController",
            "quick": quick,
            "cases": cases,
        }
    }


def _print_table(result: dict[str, Any]) -> None:
    r = result["mooncake_vs_raw_client"]
    head = (
        f"{'mode':<11}{'page':>8}{'pages':>7}{'backup':>9}{'prefetch':>9}{'put':>8}{'get':>8}"
        f"{'plugin':>9}{'raw':>8}{'ratio':>8}{'hooks':>8}{'h.ratio':>8}"
    )
    print(head)
    print("-" * len(head))
    for c in r["cases"]:
        pb = c["page_bytes"]
        label = f"{pb // MIB}MiB" if pb >= MIB else f"{pb // KIB}KiB"
        print(
            f"{c['mode']:<11}{label:>8}{c['pages']:>7}{c['plugin_backup_gbps']:>9.2f}"
            f"{c['plugin_prefetch_gbps']:>9.2f}{c['raw_put_gbps']:>8.2f}{c['raw_get_gbps']:>8.2f}"
            f"{c['plugin_gbps']:>9.2f}{c['raw_gbps']:>8.2f}{c['ratio']:>8.3f}"
            f"{2 / (1 / c['hook_set_gbps'] + 1 / c['hook_get_gbps']):>8.2f}{c['hook_ratio']:>8.3f}"
        )
    print(
        f"GB/s (1e9 B/s): best of {'/'.join(str(c['reps']) for c in r['cases'])} interleaved reps; ratio = median paired ratio. >= 256 KiB (worst): {r['ratio']:.3f} "
        f"(target {r['target']}, {'met' if r['meets_target'] else 'NOT met'}); "
        f"16 KiB worst: {r['ratio_16kib_min']:.3f}; v2 hook alone >= 256 KiB: {r['hook_ratio']:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="64 MiB per case (256 MiB without), 16 KiB and 256 KiB pages (and 2 MiB without)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
