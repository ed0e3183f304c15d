"""Overhead of the ``metrics`` extension on 128-page batches.

The same :class:`~hicache_core.CacheController` cycle, backup of 128 new pages (exists + set)
then prefetch of them (exists + get), is timed with and without ``extensions=["metrics"]`` on
an in-process dict backend (one ``bytes`` copy per key, the cheapest honest backend, so the
extension's share is as large as it can be). Both I/O paths are measured: ``v2`` (per-transfer
accounting) and ``v1`` (each call counted for the pool its ``pool_name`` names, results with list slices).
Pages are Llama-3-8B MHA KV at SGLang's default page size of 1 token: 32 layers x 8 KV heads x
128 dims in bfloat16, 64 KiB per component, the smallest realistic page (larger pages make the
extension's share smaller still).

Everything runs synchronously in the calling thread, so times are that thread's CPU time
(``time.thread_time``), with garbage collection paused while timing.

"Without" is the same controller and store with the extension unregistered from the store's
plugin manager (same memory, same backend instance), toggled between timings.

* ``ratio`` (the headline, target <= 1.03) = 1 + the extension's cost per cycle / the plain
  cycle time. The cost is measured A/B at the hook level, on the same batch shapes against a
  backend that answers at once (so no memcpy noise hides it): the store calls of a backup or
  prefetch (page keys, exists, get) are timed with and without the extension, alternating
  hundreds of times; the difference of the fastest timings (load only ever adds time) is
  doubled (a cycle makes them twice). The
  extension's work depends on the number of pages and keys, never on their bytes.
* ``cycle_ratio``: the end-to-end A/B, whole cycles alternating with and without the extension,
  median of the paired ratios (reported too; on a loaded 2-core machine its noise is a few
  percent either way, larger than the effect it measures).

The headline is the worse of the two paths.

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
BACKEND_SRC = """
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
    def hicache_clear(self, namespace):  # keeps the memory: the next cycle reuses it
        n = len(self.present)
        self.present.clear()
        return n
"""


class _Dist:
    """The dict backend as a throwaway distribution (entry points ``bench-dict``, ``bench-dict-v1``)."""

    def __enter__(self) -> _Dist:
        self.root = Path(tempfile.mkdtemp(prefix="hicache-bench-metrics-"))
        (self.root / "hicache_bench_dict.py").write_text(
            textwrap.dedent(BACKEND_SRC)
            + "\nclass DictBackendV1(DictBackend):\n"
            + "    capabilities = Capabilities(v1=True, v2=False, draft_io=DraftIoMode.UNSUPPORTED)\n"
            + "\nclass NullBackend(DictBackend):\n"
            + "    def _io(self, op, keys, views):\n"
            + "        return [True] * len(keys)\n"
            + "    @hookimpl\n"
            + "    def hicache_batch_io_v2(self, op, transfers):\n"
            + "        return [[True] * len(t) for t in transfers]\n"
            + "\nclass NullBackendV1(NullBackend):\n"
            + "    capabilities = Capabilities(v1=True, v2=False, draft_io=DraftIoMode.UNSUPPORTED)\n"
        )
        info = self.root / "hicache_bench_dict-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hicache-bench-dict\nVersion: 0.0.1\n")
        (info / "entry_points.txt").write_text(
            "[hicache.backends]\nbench-dict = hicache_bench_dict:DictBackend\n"
            "bench-dict-v1 = hicache_bench_dict:DictBackendV1\n"
            "bench-null = hicache_bench_dict:NullBackend\nbench-null-v1 = hicache_bench_dict:NullBackendV1\n"
        )
        sys.path.insert(0, str(self.root))
        importlib.invalidate_caches()
        return self

    def __exit__(self, *exc: object) -> None:
        sys.path.remove(str(self.root))
        sys.modules.pop("hicache_bench_dict", None)
        shutil.rmtree(self.root, ignore_errors=True)


def _controller(backend: str) -> CacheController:
    kv = MHAKVPool(2 * PAGES, 1, 32, 8, 128, allocate=False)
    cfg = hc.StorageConfig(backend=backend, model_name="bench", extensions=["metrics"])
    ctl = CacheController(cfg, HostPoolGroup(kv))
    for b in kv.buffers():
        b.copy_(_random(b.numel()).view(b.shape))
    return ctl


def _random(n: int) -> Any:
    import torch

    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))


class _Toggle:
    """The same controller with and without the extension (unregistered from the store's plugin manager)."""

    NAME = "extension:metrics"

    def __init__(self, ctl: CacheController) -> None:
        self.pm = ctl.store.pm
        self.ext = ctl.store.extensions["metrics"]

    def __call__(self, on: bool) -> None:
        registered = self.pm.get_plugin(self.NAME) is not None
        if on and not registered:
            self.pm.register(self.ext, name=self.NAME)
        elif not on and registered:
            self.pm.unregister(name=self.NAME)


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


def _hook_calls(ctl: CacheController, hashes: list[str]) -> Any:
    """A timer of the store calls one backup or prefetch makes (page keys, exists, get)."""
    from hicache_core import IoOp, PoolName, PoolTransfer

    store = ctl.store
    keys = store.page_keys(PoolName.KV, hashes)
    flat = [k for page in keys for k in page]
    views = [v for page in ctl.pools.anchor.page_views(range(PAGES)) for v in page]
    transfer = [PoolTransfer(PoolName.KV, tuple(range(PAGES)), tuple(hashes), keys=tuple(keys))]
    v2 = ctl.io_path == "v2"
    if v2:
        store.batch_io_v2(IoOp.SET, transfer)
    else:
        store.batch_io_v1(IoOp.SET, flat, views)

    def one() -> float:
        t0 = time.thread_time()
        store.page_keys(PoolName.KV, hashes)
        if v2:
            store.batch_io_v2(IoOp.EXISTS, transfer)
            store.batch_io_v2(IoOp.GET, transfer)
        else:
            store.batch_io_v1(IoOp.EXISTS, flat)
            store.batch_io_v1(IoOp.GET, flat, views)
        return time.thread_time() - t0

    return one


def _paired(run_once: Any, toggle: _Toggle, n: int) -> tuple[list[float], list[float]]:
    """``n`` alternating (with, without) timings of ``run_once``."""
    on: list[float] = []
    off: list[float] = []
    for i in range(n):
        for flag in (True, False) if i % 2 == 0 else (False, True):
            toggle(flag)
            (on if flag else off).append(run_once())
    toggle(True)
    return on, off


def measure(backend: str, rounds: int, cycles: int) -> dict[str, Any]:
    hashes = hc.page_hashes(list(range(4 * PAGES)), 4)
    ctl = _controller(backend)
    toggle = _Toggle(ctl)
    try:
        for _ in range(3):  # warm-up
            _cycle(ctl, hashes)
        with_ext, without = _paired(lambda: _cycle(ctl, hashes), toggle, rounds * cycles)
        counted = ctl.store.extensions["metrics"].snapshot()["totals"]["bytes_written"]  # type: ignore[attr-defined]
    finally:
        ctl.close()
    null = _controller(backend.replace("dict", "null"))
    try:
        calls_on, calls_off = _paired(_hook_calls(null, hashes), _Toggle(null), 100 * rounds)
    finally:
        null.close()
    expected = PAGES * 2 * 65536 * (3 + rounds * cycles)
    if counted != expected:
        raise RuntimeError(f"metrics counted {counted} bytes written, expected {expected}")
    plain = statistics.median(without)
    extra = 2 * max(0.0, min(calls_on) - min(calls_off))  # a cycle = backup + prefetch
    return {
        "plain_ms": plain * 1e3,
        "metrics_ms": statistics.median(with_ext) * 1e3,
        "ratio": 1.0 + extra / plain,
        "extension_us_per_cycle": extra * 1e6,
        "cycle_ratio": statistics.median([a / b for a, b in zip(with_ext, without)]),
        "best_cycle_ratio": min(with_ext) / min(without),
        "pairs": len(with_ext),
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
                f"{path}: cycle {p['plain_ms']:.3f} ms, extension +{p['extension_us_per_cycle']:.1f} us "
                f"-> ratio {p['ratio']:.4f}; end-to-end A/B {p['cycle_ratio']:.4f} over {p['pairs']} pairs "
                f"(best cycles {p['best_cycle_ratio']:.4f})"
            )
        verdict = "meets" if m["meets_target"] else "MISSES"
        print(f"metrics overhead ratio {m['ratio']:.4f} {verdict} target <= {m['target']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
