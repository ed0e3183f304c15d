"""Mooncake plugin vs the raw Mooncake client, on the same pages, in the same run.

For each mode (embedded ``setup``; standalone ``setup_dummy`` against a real ``mooncake_client``)
and page size, one MLA-style KV pool (one object per page) is attached through the
``CacheController``. Each repetition, on fresh page hashes:

* plugin: ``backup`` (existence check + zero-copy v2 put) and ``prefetch`` (existence check +
  zero-copy v2 get) of every page;
* raw: ``batch_put_from`` then ``batch_get_into`` on the SAME registered pages, with the same
  number of keys per call, through the same ``MooncakeDistributedStore`` instance.

Bytes are verified after every timed prefetch / get. GB/s = 1e9 bytes per second; the combined
figure is ``2 * bytes / (t_write + t_read)``; the ratio is plugin / raw (medians). The headline
ratio is the worst case over page sizes >= 256 KiB (target 0.95); 16 KiB is reported too.

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
from typing import Any

TARGET = 0.95
KIB = 1 << 10
MIB = 1 << 20


def _hashes(n: int) -> list[str]:
    from hicache_core import page_hashes

    return page_hashes([hash((uuid.uuid4().int, i)) & 0x7FFFFFFF for i in range(n)], 1)


def _bench_case(opts: dict[str, Any], page_bytes: int, total: int, reps: int, chunk: int) -> dict[str, Any]:
    import torch

    from hicache_core import CacheController, MLAKVPool, StorageConfig

    n = total // page_bytes
    cfg = StorageConfig(
        backend="mooncake",
        options=opts,
        model_name=f"bench-{page_bytes}",
        is_mla_model=True,
        kv_dtype="uint8",
        batch_pages=chunk,
    )
    pool = MLAKVPool(n, 1, 1, page_bytes, torch.uint8, allocate=False)
    with CacheController(cfg, pool) as ctl:
        backend: Any = ctl.store.backend
        raw = backend.link.store  # the very MooncakeDistributedStore the plugin uses
        buf = pool.buffers()[0]
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
        ref = buf.clone()
        idx = list(range(n))
        ptrs = [buf.data_ptr() + i * page_bytes for i in idx]
        sizes = [page_bytes] * n

        def raw_put(keys: list[str]) -> None:
            for s in range(0, n, chunk):
                res = raw.batch_put_from(keys[s : s + chunk], ptrs[s : s + chunk], sizes[s : s + chunk])
                assert all(r == 0 for r in res), set(res)

        def raw_get(keys: list[str]) -> None:
            for s in range(0, n, chunk):
                res = raw.batch_get_into(keys[s : s + chunk], ptrs[s : s + chunk], sizes[s : s + chunk])
                assert all(r == page_bytes for r in res), set(res)

        def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0

        # warm up: fault in the store segment and both code paths once (not timed)
        warm = [f"warm-{uuid.uuid4().hex}-{i}" for i in range(n)]
        raw_put(warm)
        raw.remove_all(True)
        results: dict[str, list[float]] = {"plugin_w": [], "plugin_r": [], "raw_w": [], "raw_r": []}
        for _ in range(reps):
            # plugin: backup + prefetch through the controller (v2, zero copy)
            hashes = _hashes(n)
            res, tw = timed(lambda h=hashes: ctl.backup(h, idx))  # type: ignore[misc]
            assert res.ok and res.pages == n, res
            buf.zero_()
            res, tr = timed(lambda h=hashes: ctl.prefetch(h, idx))  # type: ignore[misc]
            assert res.pages == n, res
            assert torch.equal(buf, ref), "plugin prefetch: bytes differ"
            results["plugin_w"].append(tw)
            results["plugin_r"].append(tr)
            raw.remove_all(True)
            # raw client on the same pages
            keys = [f"raw-{uuid.uuid4().hex[:12]}-{i}" for i in range(n)]
            _, tw = timed(lambda k=keys: raw_put(k))  # type: ignore[misc]
            buf.zero_()
            _, tr = timed(lambda k=keys: raw_get(k))  # type: ignore[misc]
            assert torch.equal(buf, ref), "raw get: bytes differ"
            results["raw_w"].append(tw)
            results["raw_r"].append(tr)
            raw.remove_all(True)
    med = {k: statistics.median(v) for k, v in results.items()}
    gbps = {k: total / v / 1e9 for k, v in med.items()}
    plugin = 2 * total / (med["plugin_w"] + med["plugin_r"]) / 1e9
    rawc = 2 * total / (med["raw_w"] + med["raw_r"]) / 1e9
    per_rep = [
        (results["raw_w"][i] + results["raw_r"][i]) / (results["plugin_w"][i] + results["plugin_r"][i])
        for i in range(reps)
    ]
    return {
        "page_bytes": page_bytes,
        "pages": n,
        "total_bytes": total,
        "keys_per_call": chunk,
        "reps": reps,
        "plugin_backup_gbps": round(gbps["plugin_w"], 3),
        "plugin_prefetch_gbps": round(gbps["plugin_r"], 3),
        "raw_put_gbps": round(gbps["raw_w"], 3),
        "raw_get_gbps": round(gbps["raw_r"], 3),
        "plugin_gbps": round(plugin, 3),
        "raw_gbps": round(rawc, 3),
        "ratio": round(plugin / rawc, 4),
        "ratio_per_rep": [round(r, 4) for r in per_rep],
    }


def run(quick: bool) -> dict[str, Any]:
    """Run the benchmark; return ``{"mooncake_vs_raw_client": {...}}``."""
    import torch

    from hicache_mooncake.testing import MooncakeMaster, MooncakeStandalone

    torch.set_num_threads(1)
    logging.getLogger("hicache").setLevel(logging.ERROR)
    total = 64 * MIB if quick else 256 * MIB
    reps = 3 if quick else 5
    pages = [16 * KIB, 256 * KIB] if quick else [16 * KIB, 256 * KIB, 2 * MIB]
    chunk = 1024
    cases: list[dict[str, Any]] = []
    seg = f"{max(512, 4 * total // MIB)}MB"
    with MooncakeMaster() as master:
        opts = {
            "master_server_address": master.address,
            "local_hostname": "127.0.0.1",
            "global_segment_size": seg,
            "load_env": False,
        }
        for pb in pages:
            cases.append({"mode": "embedded", **_bench_case(opts, pb, total, reps, chunk)})
    with MooncakeStandalone(global_segment_size=seg) as cluster:
        opts = cluster.options(load_env=False)
        for pb in pages:
            cases.append({"mode": "standalone", **_bench_case(opts, pb, total, reps, chunk)})
    big = [c["ratio"] for c in cases if c["page_bytes"] >= 256 * KIB]
    small = [c["ratio"] for c in cases if c["page_bytes"] < 256 * KIB]
    ratio = min(big)
    return {
        "mooncake_vs_raw_client": {
            "ratio": ratio,
            "target": TARGET,
            "meets_target": ratio >= TARGET,
            "ratio_definition": "min over modes and page sizes >= 256 KiB of plugin/raw "
            "(backup+prefetch vs batch_put_from+batch_get_into, median GB/s)",
            "ratio_16kib_min": min(small) if small else None,
            "quick": quick,
            "cases": cases,
        }
    }


def _print_table(result: dict[str, Any]) -> None:
    r = result["mooncake_vs_raw_client"]
    head = (
        f"{'mode':<11}{'page':>8}{'pages':>7}{'backup':>9}{'prefetch':>9}{'put':>8}{'get':>8}"
        f"{'plugin':>9}{'raw':>8}{'ratio':>8}"
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
        )
    print(
        f"GB/s (1e9 B/s), medians. ratio >= 256 KiB (worst): {r['ratio']:.3f} "
        f"(target {r['target']}, {'met' if r['meets_target'] else 'NOT met'}); "
        f"16 KiB worst: {r['ratio_16kib_min']:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB per case, 3 repetitions")
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
