"""Dispatch overhead: the controller's pluggy path vs calling the backend object directly.

One iteration = backup + prefetch of one 128-page batch (MHA ``page_first``, two components per
page) on :class:`MemcpyBackend`, an in-benchmark backend whose I/O is one ``copy_`` per page
component into / out of a preallocated, pre-faulted arena:

* **hooked**: ``controller.backup(hashes, idx)`` then ``controller.prefetch(hashes, idx)``:
  hash checks, planning, key resolution through ``hicache_page_keys``, page views, the store's
  checks and the pluggy hook calls (``exists`` + ``set`` for the backup; the prefetch has no
  existence pass without trailing-state pools, so just ``get``);
* **direct**: what a caller without the framework has to do for the same result: per operation,
  derive the keys with the key scheme's method (called directly, no pluggy) and build the page
  views (v1) or the ``PoolTransfer`` (v2), then call the same backend object's hook methods by
  hand, exactly the calls the hooked side makes: ``exists``, ``set``, then ``get``.

The backend forgets its keys between iterations (outside the timed region), so every backup
writes. Both sides run interleaved (alternating which goes first), many times, synchronously in
one thread; the ratio is the median over iterations of hooked / direct thread CPU time of that
iteration, a paired estimate that cancels the load drifts of a shared machine (target <= 1.02,
lower is better; wall time also counts other processes' preemption, so its ratio of medians is
reported beside, as is ``ratio_of_medians`` of CPU time),
also shown as µs per iteration and overhead µs per batch operation. The headline
``dispatch_overhead`` uses the v2 path (what the file and mooncake backends use) at 256 KiB
pages; v1 and other page sizes are reported alongside.

``--profile`` prints a cProfile of the hooked path at small pages (where the overhead shows).

Run: ``python benchmarks/bench_dispatch.py [--quick] [--json] [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from ctypes import memmove
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from hicache_core import (
    CacheController,
    Capabilities,
    DraftIo,
    DraftIoMode,
    IoOp,
    MHAKVPool,
    PoolName,
    PoolTransfer,
    StorageConfig,
    hookimpl,
    page_hashes,
)

BATCH = 128
SMOKE = os.environ.get("HICACHE_BENCH_SMOKE", "") not in ("", "0")
TARGET = 1.02
HEADLINE = ("v2", 256 * 1024)
LAYERS, HEADS, HEAD_DIM = 16, 2, 64  # bf16: 4 KiB per token (K+V) -> page bytes = 4 KiB * tokens


class MemcpyBackend:
    """A v1 backend whose I/O is one ``memmove`` per object into a preallocated arena."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        arena_bytes: int = 0

    capabilities = Capabilities(v1=True, v2=False, persistent=False, shared=False)

    def __init__(self, config: Any, options: Any) -> None:
        self.arena = torch.zeros(options.arena_bytes, dtype=torch.uint8)  # pre-faulted
        self.base = self.arena.data_ptr()
        self.data: dict[str, tuple[int, int]] = {}  # key -> (address, size) in the arena
        self.offset = 0
        self.pools: dict[PoolName, Any] = {}

    def reset(self) -> None:
        """Forget every key (not timed)."""
        self.data.clear()
        self.offset = 0

    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: Any) -> None:
        self.pools[pool_name] = pool

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        return DraftIo(DraftIoMode.UNSUPPORTED, "benchmark backend")

    @hookimpl
    def hicache_batch_io_v1(self, op: IoOp, keys: Sequence[str], buffers: Any) -> list[bool]:
        data = self.data
        if op is IoOp.EXISTS:
            return [k in data for k in keys]
        if op is IoOp.SET:
            for k, b in zip(keys, buffers):
                n = b.numel()
                slot = data.get(k)
                if slot is None:
                    slot = data[k] = (self.base + self.offset, n)
                    self.offset += n
                memmove(slot[0], b.data_ptr(), n)
            return [True] * len(keys)
        out = []
        for k, b in zip(keys, buffers):
            slot = data.get(k)
            if slot is not None and slot[1] == b.numel():
                memmove(b.data_ptr(), slot[0], slot[1])
                out.append(True)
            else:
                out.append(False)
        return out


class MemcpyBackendV2(MemcpyBackend):
    """The same backend with the v2 (multi-pool) path; page views are taken by the backend."""

    capabilities = Capabilities(v1=True, v2=True, persistent=False, shared=False)

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        out = []
        for t in transfers:
            if op is IoOp.EXISTS:
                out.append([all(k in self.data for k in ks) for ks in t.keys])
                continue
            views = self.pools[t.pool].page_views(t.host_indices)
            flat_keys = [k for ks in t.keys for k in ks]
            flat_views = [v for page in views for v in page]
            res = self.hicache_batch_io_v1(op, flat_keys, flat_views)
            c = len(t.keys[0]) if t.keys else 1
            out.append([all(res[i : i + c]) for i in range(0, len(res), c)])
        return out


_ENTRY = {"v1": "bench-memcpy-v1", "v2": "bench-memcpy-v2"}
_CLASSES = {"v1": MemcpyBackend, "v2": MemcpyBackendV2}
_MODULE = "hicache_bench_dispatch"


@contextmanager
def installed_backends() -> Iterator[None]:
    """Declare the in-benchmark backends through a real (temporary) ``*.dist-info`` on ``sys.path``.

    The entry points name this module as ``hicache_bench_dispatch``, so discovery and loading go
    through the ordinary entry-point path however this file was imported.
    """
    sys.modules[_MODULE] = sys.modules[__name__]
    with tempfile.TemporaryDirectory(prefix="hicache-bench-dispatch-") as root:
        info = os.path.join(root, "hicache_bench_dispatch-0.0.0.dist-info")
        os.mkdir(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: hicache-bench-dispatch\nVersion: 0.0.0\n")
        with open(os.path.join(info, "entry_points.txt"), "w") as f:
            f.write("[hicache.backends]\n")
            f.writelines(f"{_ENTRY[p]} = {_MODULE}:{cls.__name__}\n" for p, cls in _CLASSES.items())
        sys.path.insert(0, root)
        importlib.invalidate_caches()
        try:
            yield
        finally:
            sys.path.remove(root)
            importlib.invalidate_caches()


class Case:
    """One (path, page size) setting: a controller and the direct call sequence on its backend."""

    def __init__(self, path: str, page_bytes: int) -> None:
        tokens = max(1, page_bytes // (LAYERS * HEADS * HEAD_DIM * 2 * 2))
        self.pool = MHAKVPool(BATCH, tokens, LAYERS, HEADS, HEAD_DIM, torch.bfloat16, allocate=False)
        self.page_bytes = self.pool.page_nbytes
        config = StorageConfig(
            backend=_ENTRY[path],
            options={"arena_bytes": 2 * BATCH * self.page_bytes},
            model_name="dispatch-bench",
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.ctl = CacheController(config, self.pool)
        for b in self.pool.buffers():
            b.random_(0, 256)
        self.backend: MemcpyBackend = self.ctl.store.backend  # type: ignore[assignment]
        tokens_ids = torch.randint(0, 150_000, (BATCH * tokens,), dtype=torch.int32)
        self.hashes = page_hashes(tokens_ids, tokens)
        self.indices = list(range(BATCH))
        self.path = path

    def hooked(self) -> None:
        b = self.ctl.backup(self.hashes, self.indices)
        p = self.ctl.prefetch(self.hashes, self.indices)
        assert b.pages == BATCH and p.pages == BATCH, (b, p)

    def direct(self) -> None:
        """The work a caller without the framework must do: per operation, derive the keys
        (the key scheme's method, called directly) and the page views or transfer, then call the
        backend's hook methods directly."""
        be, keys_of = self.backend, self.ctl.store.keys.hicache_page_keys
        for ops in ((IoOp.EXISTS, IoOp.SET), (IoOp.GET,)):  # backup, then prefetch
            page_keys = keys_of(PoolName.KV, self.hashes)
            if self.path == "v1":
                keys = [k for ks in page_keys for k in ks]
                views = [v for page in self.pool.page_views(self.indices) for v in page]
                for op in ops:
                    res = be.hicache_batch_io_v1(op, keys, None if op is IoOp.EXISTS else views)
                    assert all(res) is (op is not IoOp.EXISTS)
            else:
                assert isinstance(be, MemcpyBackendV2)
                transfers = [PoolTransfer(PoolName.KV, self.indices, self.hashes, keys=page_keys)]
                for op in ops:
                    res = be.hicache_batch_io_v2(op, transfers)[0]
                    assert all(res) is (op is not IoOp.EXISTS)

    def close(self) -> None:
        self.ctl.close()


def _time(fn: Callable[[], None], reset: Callable[[], None]) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) of one call of ``fn``, after an untimed ``reset``."""
    reset()
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c0, time.perf_counter() - w0


def _sample(path: str, page_bytes: int, iters: int) -> tuple[dict[str, list[tuple[float, float]]], int]:
    """``iters`` interleaved (hooked, direct) pairs on one freshly allocated case; its page size."""
    case = Case(path, page_bytes)
    try:
        for _ in range(3):  # warm-up (first-call costs, caches)
            _time(case.hooked, case.backend.reset)
            _time(case.direct, case.backend.reset)
        runs: dict[str, list[tuple[float, float]]] = {"hooked": [], "direct": []}
        gc.disable()
        try:
            for i in range(iters):
                order = ("hooked", "direct") if i % 2 == 0 else ("direct", "hooked")
                for side in order:
                    runs[side].append(_time(getattr(case, side), case.backend.reset))
        finally:
            gc.enable()
        return runs, case.page_bytes
    finally:
        case.close()


def measure(path: str, page_bytes: int, iters: int, allocations: int = 1) -> dict[str, Any]:
    """Interleaved hooked/direct iterations (3 backend calls each); medians in µs.

    Everything runs synchronously in this thread, so the headline uses the thread's CPU time
    (preemption by other processes on a shared machine does not count); wall time is reported
    too. With ``allocations > 1`` the iterations are split over that many freshly allocated
    cases (pools, arena, controller) and pooled: where the buffers land shifts one case's
    ratio by up to +-2% on this machine, more than the iterations of one case vary.
    """
    runs: dict[str, list[tuple[float, float]]] = {"hooked": [], "direct": []}
    for _ in range(allocations):
        part, actual_page_bytes = _sample(path, page_bytes, -(-iters // allocations))
        for side in runs:
            runs[side] += part[side]
    cpu = {k: statistics.median(c for c, _ in v) for k, v in runs.items()}
    wall = {k: statistics.median(w for _, w in v) for k, v in runs.items()}
    h, d = cpu["hooked"], cpu["direct"]
    # Paired estimate: iteration i ran both sides back to back, so their ratio cancels load
    # drifts of the shared machine; the median ignores outlier iterations.
    paired = statistics.median(hc / dc for (hc, _), (dc, _) in zip(runs["hooked"], runs["direct"]))
    return {
        "path": path,
        "page_bytes": actual_page_bytes,
        "batch_pages": BATCH,
        "iterations": len(runs["hooked"]),
        "allocations": allocations,
        "hooked_us": h * 1e6,
        "direct_us": d * 1e6,
        "overhead_us_per_batch_op": (h - d) * 1e6 / 2,  # backup and prefetch
        "ratio": paired,
        "ratio_of_medians": h / d,
        "wall_hooked_us": wall["hooked"] * 1e6,
        "wall_direct_us": wall["direct"] * 1e6,
        "wall_ratio": wall["hooked"] / wall["direct"],
    }


def profile_hooked(path: str = "v2", page_bytes: int = 16 * 1024, iters: int = 200, top: int = 25) -> str:
    """cProfile of the hooked path (tottime order): where the controller's time goes."""
    case = Case(path, page_bytes)
    try:
        prof = cProfile.Profile()
        for _ in range(iters):
            case.backend.reset()
            prof.enable()
            case.hooked()
            prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        return out.getvalue()
    finally:
        case.close()


def run(quick: bool = False) -> dict[str, Any]:
    """Return ``{"dispatch_overhead": {...}}`` (headline: v2 at 256 KiB pages) with every case."""
    if SMOKE:  # tests: only prove it runs and reports
        sizes, iters = (HEADLINE[1],), 4
    elif quick:
        sizes, iters = (16 * 1024, 256 * 1024), 60
    else:
        sizes, iters = (16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024), 100
    with installed_backends():
        cases = [
            measure(path, size, iters * 2, allocations=4)
            if (path, size) == HEADLINE and not SMOKE
            else measure(path, size, iters)
            for path in ("v1", "v2")
            for size in sizes
        ]
    head = next(c for c in cases if (c["path"], c["page_bytes"]) == HEADLINE)
    return {
        "dispatch_overhead": {
            "ratio": head["ratio"],
            "target": TARGET,
            "meets_target": head["ratio"] <= TARGET,
            "headline": f"{HEADLINE[0]}, {HEADLINE[1] // 1024} KiB pages, {BATCH}-page batches",
            "hooked_us": head["hooked_us"],
            "direct_us": head["direct_us"],
            "overhead_us_per_batch_op": head["overhead_us_per_batch_op"],
            "cases": cases,
        }
    }


def table(result: dict[str, Any]) -> str:
    r = result["dispatch_overhead"]
    lines = [
        f"{'path':<5} {'page':>9} {'hooked µs':>11} {'direct µs':>11} {'overhead µs/op':>15} {'ratio':>7} "
        f"{'wall ratio':>10}",
    ]
    for c in r["cases"]:
        lines.append(
            f"{c['path']:<5} {c['page_bytes'] // 1024:>6} KiB {c['hooked_us']:>11.1f} {c['direct_us']:>11.1f} "
            f"{c['overhead_us_per_batch_op']:>15.1f} {c['ratio']:>7.3f} {c['wall_ratio']:>10.3f}"
        )
    lines.append(
        f"dispatch_overhead ({r['headline']}): ratio {r['ratio']:.3f} (target <= {r['target']}) -> "
        f"{'OK' if r['meets_target'] else 'MISSED'}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the hooked path")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(json.dumps(result, indent=2) if args.json else table(result))
    if args.profile:
        with installed_backends():
            print(profile_hooked(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
