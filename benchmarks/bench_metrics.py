"""Overhead of the ``metrics`` extension on 128-page batches.

The same :class:`~hicache_core.CacheController` cycle, backup of 128 new pages (exists + set)
then prefetch of them (exists + get), is timed with and without ``extensions=["metrics"]`` on
an in-process dict backend (one ``bytes`` copy per key, the cheapest honest backend, so the
extension's share is as large as it can be). Both I/O paths are measured: ``v2`` (per-transfer
accounting) and ``v1`` (pool blocks found by bisection, results counted with list slices).
Pages are Llama-3-8B MHA KV at SGLang's default page size of 1 token: 32 layers x 8 KV heads x
128 dims in bfloat16, 64 KiB per component, the smallest realistic page (larger pages make the
extension's share smaller still).

Ratio = time with metrics / time without (target <= 1.03). Everything runs synchronously in
the calling thread, so the time is that thread's CPU time (``time.thread_time``), and garbage
collection is paused while timing. The variants alternate cycle by cycle; each adjacent pair
gives one ratio and the reported ``ratio`` is the median over all pairs (robust to load from
other processes, which drifts slowly). The ratio of each side's best cycle is reported too.
The headline ``ratio`` is the worse of the two paths.

Usage::

    python benchmarks/bench_metrics.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import hicache_core as hc
from hicache_core import CacheController, HostPoolGroup, MHAKVPool

TARGET = 1.03
PAGES = 128
BACKEND_SRC = '''
from pydantic import BaseModel, ConfigDict
from hicache_core import Capabilities, DraftIo, DraftIoMode, IoOp, hookimpl

class DictBackend:
    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    capabilities = Capabilities(v1=True, v2=True, draft_io=DraftIoMode.UNSUPPORTED)

    def __init__(self, config, options):
        self.data = {}  # key -> bytearray, kept across clear() so cycles reuse the memory
        self.present = set()
        self.pools = {}

    @hookimpl
    def hicache_register_pool(self, pool_name, pool):
        self.pools[pool_name] = pool

    @hookimpl
    def hicache_draft_io_capability(self):
        return DraftIo(DraftIoMode.UNSUPPORTED, "bench")

    def _io(self, op, keys, views):
        data, present = self.data, self.present
        if op is IoOp.EXISTS:
            return [k in present for k in keys]
        if op is IoOp.SET:
            for k, v in zip(keys, views):
                src = v.numpy()
                buf = data.get(k)
                if buf is None or len(buf) != src.nbytes:
                    data[k] = buf = bytearray(src.nbytes)
                memoryview(buf)[:] = src
                present.add(k)
            return [True] * len(keys)
        out = []
        for k, v in zip(keys, views):
            if k in present:
                v.numpy()[:] = memoryview(data[k])
                out.append(True)
            else:
                out.append(False)
        return out

    @hookimpl
    def hicache_batch_io_v1(self, op, keys, buffers):
        return self._io(op, keys, buffers)

    @hookimpl
    def hicache_batch_io_v2(self, op, transfers):
        out = []
        for t in transfers:
            keys = [k for page in t.keys for k in page]
            views = None
            if op is not IoOp.EXISTS:
                views = [v for page in self.pools[t.pool].page_views(t.host_indices) for v in page]
            flat = self._io(op, keys, views)
            c = len(t.keys[0]) if t.keys else 1
            out.append([all(flat[i : i + c]) for i in range(0, len(flat), c)])
        return out

    @hookimpl
    def hicache_clear(self, namespace):
        n = len(self.present)
        self.present.clear()
        return n
'''


class _Dist:
    """The dict backend as a throwaway distribution (entry points ``bench-dict``, ``bench-dict-v1``)."""

    def __enter__(self) -> _Dist:
        self.root = Path(tempfile.mkdtemp(prefix="hicache-bench-metrics-"))
        (self.root / "hicache_bench_dict.py").write_text(
            textwrap.dedent(BACKEND_SRC)
            + "\nclass DictBackendV1(DictBackend):\n"
            + "    capabilities = Capabilities(v1=True, v2=False, draft_io=DraftIoMode.UNSUPPORTED)\n"
        )
        info = self.root / "hicache_bench_dict-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hicache-bench-dict\nVersion: 0.0.1\n")
        (info / "entry_points.txt").write_text(
            "[hicache.backends]\nbench-dict = hicache_bench_dict:DictBackend\n"
            "bench-dict-v1 = hicache_bench_dict:DictBackendV1\n"
        )
        sys.path.insert(0, str(self.root))
        importlib.invalidate_caches()
        return self

    def __exit__(self, *exc: object) -> None:
        sys.path.remove(str(self.root))
        sys.modules.pop("hicache_bench_dict", None)
        shutil.rmtree(self.root, ignore_errors=True)


def _controller(backend: str, metrics: bool) -> CacheController:
    kv = MHAKVPool(2 * PAGES, 1, 32, 8, 128, allocate=False)
    cfg = hc.StorageConfig(backend=backend, model_name="bench", extensions=["metrics"] if metrics else [])
    ctl = CacheController(cfg, HostPoolGroup(kv))
    for b in kv.buffers():
        b.copy_(hc_random(b.numel()).view(b.shape))
    return ctl


def hc_random(n: int) -> Any:
    import torch

    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))


def _cycle(ctl: CacheController, hashes: list[str]) -> float:
    gc.disable()
    try:
        t0 = time.thread_time()
        b = ctl.backup(hashes, range(PAGES))
        p = ctl.prefetch(hashes, range(PAGES, 2 * PAGES))
        elapsed = time.thread_time() - t0
    finally:
        gc.enable()
    if b.pages != PAGES or p.pages != PAGES:
        raise RuntimeError(f"bench cycle moved {b.pages}/{p.pages} of {PAGES} pages")
    ctl.clear()  # untimed: the next cycle writes again
    return elapsed


def measure(backend: str, rounds: int, cycles: int) -> dict[str, Any]:
    hashes = hc.page_hashes(list(range(4 * PAGES)), 4)
    ctls = {"plain": _controller(backend, False), "metrics": _controller(backend, True)}
    try:
        for ctl in ctls.values():  # warm-up
            for _ in range(3):
                _cycle(ctl, hashes)
        times: dict[str, list[float]] = {k: [] for k in ctls}
        for r in range(rounds * cycles):
            for name in list(ctls) if r % 2 == 0 else reversed(list(ctls)):
                times[name].append(_cycle(ctls[name], hashes))
        snap = ctls["metrics"].store.extensions["metrics"].snapshot()  # type: ignore[attr-defined]
    finally:
        for ctl in ctls.values():
            ctl.close()
    best = {k: min(v) for k, v in times.items()}
    pairs = [m / p for m, p in zip(times["metrics"], times["plain"])]
    expected = PAGES * 2 * 65536 * (3 + rounds * cycles)
    if snap["totals"]["bytes_written"] != expected:
        raise RuntimeError(f"metrics counted {snap['totals']['bytes_written']} bytes written, expected {expected}")
    return {
        "plain_ms": statistics.median(times["plain"]) * 1e3,
        "metrics_ms": statistics.median(times["metrics"]) * 1e3,
        "ratio": statistics.median(pairs),
        "best_ratio": best["metrics"] / best["plain"],
        "pairs": len(pairs),
        "overhead_us_per_cycle": (statistics.median(times["metrics"]) - statistics.median(times["plain"])) * 1e6,
    }


def run(quick: bool = False) -> dict[str, Any]:
    rounds, cycles = (4, 10) if quick else (20, 10)
    with _Dist():
        paths = {"v2": measure("bench-dict", rounds, cycles), "v1": measure("bench-dict-v1", rounds, cycles)}
    ratio = max(p["ratio"] for p in paths.values())
    return {
        "metrics_overhead": {
            "ratio": ratio,
            "target": TARGET,
            "meets_target": ratio <= TARGET,
            "pages_per_batch": PAGES,
            "paths": paths,
        }
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (CI smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args.quick)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        m = result["metrics_overhead"]
        for path, p in m["paths"].items():
            print(
                f"{path}: plain {p['plain_ms']:.3f} ms  metrics {p['metrics_ms']:.3f} ms  ratio {p['ratio']:.4f} "
                f"(best-cycle ratio {p['best_ratio']:.4f}, {p['pairs']} pairs, "
                f"{p['overhead_us_per_cycle']:+.1f} us per backup+prefetch)"
            )
        verdict = "meets" if m["meets_target"] else "MISSES"
        print(f"metrics overhead ratio {m['ratio']:.4f} {verdict} target <= {m['target']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
