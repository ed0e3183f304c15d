"""The ``metrics`` extension: storage I/O metrics for whichever backend is selected.

Enable it with ``StorageConfig(extensions=["metrics"])`` or ``enable_storage_metrics=True``.
It is registered in the store's plugin manager as ``extension:metrics`` and wraps the I/O hooks
of the selected backend with pluggy ``wrapper=True`` hook implementations; it never changes a
result. Per store it records:

* pages and bytes read (``get``) and written (``set``) per pool, and failed pages per pool;
* existence hits and misses per pool (pages) and the number of ``exists`` calls;
* a latency histogram per operation and I/O path (``v1``/``v2``);
* errors by exception type (exceptions raised by the backend, and results that break the
  contract: ``None`` or a wrong-length list, counted as ``BackendContractError``);
* integrity failures reported by the backend (see below);
* whether draft KV offload is enabled, with the declared mode and the reason.

Counting is per call, never per page in Python: v2 uses ``len()`` of each transfer and the
pool's page size; v1 finds the pool blocks of the controller's key layout by bisection on the
key prefix (``key[:-len(page_hash)]``, parsed once as the core's ``{namespace}.{pool}.{component}
.{ranks}.`` layout) and counts results with list slices; keys in any other order are counted one
by one, and keys of another scheme are counted under pool ``unknown`` with their buffer sizes. Bytes are those the
backend reported moved (a ``set`` skipped because the page already existed counts as written).
A call abandoned by the controller's ``io_timeout_s`` is recorded when it finally returns.

**Integrity convention for backends.** A backend that verifies what it reads exposes an integer
attribute ``integrity_errors`` on its instance: the number of objects that failed verification
(bad checksum, truncated, wrong header) and were therefore reported as misses. It only ever
grows. The backend also logs each failure (WARNING, naming the key). The extension reads the
attribute when metrics are collected, through :meth:`MetricsExtension.bind_store`, so a
backend pays nothing per call and needs no dependency on this module.

**Exposition.** ``ext.registry`` is a :class:`prometheus_client.CollectorRegistry` of this
store's metrics that an engine can mount (``generate_latest(ext.registry)``); every sample
carries the labels ``backend`` and ``store`` (a per-process sequence number). A standalone HTTP
exporter serving every live store of the process is started only when asked: call
:func:`start_exporter`, or set ``HICACHE_METRICS_PORT`` (and optionally
``HICACHE_METRICS_ADDR``, default ``127.0.0.1``) before the first store opens. Extension
settings never come from ``config.options``, which belong to the backend.
``prometheus_client`` is imported lazily; without it the extension raises
:class:`~hicache_core.BackendUnavailableError` with the install hint.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailableError, ConfigError
from ..hookspecs import hookimpl
from ..types import DraftIo, DraftIoMode, IoOp, PoolName, PoolTransfer

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import StorageConfig
    from ..plugin import Store
    from ..pools import HostPool

__all__ = [
    "ADDR_ENV",
    "INSTALL_HINT",
    "LATENCY_BUCKETS",
    "PORT_ENV",
    "MetricsExtension",
    "format_summary",
    "start_exporter",
]

log = logging.getLogger("hicache.metrics")

INSTALL_HINT = "pip install 'hicache-core[metrics]'"
PORT_ENV = "HICACHE_METRICS_PORT"
ADDR_ENV = "HICACHE_METRICS_ADDR"
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
UNKNOWN_POOL = "unknown"
_EXISTS, _GET, _SET = IoOp.EXISTS, IoOp.GET, IoOp.SET
_DIRECTION = {IoOp.GET: "read", IoOp.SET: "write"}
_store_ids = itertools.count()


def _bools(flags: list[Any]) -> bool:
    return type(flags[0]) is bool and type(flags[-1]) is bool


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as err:
        raise BackendUnavailableError(
            f"the 'metrics' extension needs prometheus_client ({err}); install it with `{INSTALL_HINT}` "
            "or remove 'metrics' from extensions / set enable_storage_metrics=False"
        ) from None
    return prometheus_client


@dataclass(frozen=True)
class _PoolInfo:
    components: tuple[str, ...]
    component_nbytes: tuple[int, ...]

    @property
    def page_nbytes(self) -> int:
        return sum(self.component_nbytes)


class _Histogram:
    """Non-cumulative bucket counts (the last one is +Inf), a sum and a count."""

    __slots__ = ("count", "counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """Estimate by linear interpolation inside the bucket (as Prometheus' histogram_quantile)."""
        if not self.count:
            return None
        rank, seen = q * self.count, 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= rank:
                lo = LATENCY_BUCKETS[i - 1] if i > 0 else 0.0
                hi = LATENCY_BUCKETS[i] if i < len(LATENCY_BUCKETS) else LATENCY_BUCKETS[-1]
                return lo + (hi - lo) * (rank - seen) / c
            seen += c
        return LATENCY_BUCKETS[-1]  # pragma: no cover - rank <= count always lands above


class MetricsExtension:
    """Records storage metrics of one store; see the module docstring."""

    def __init__(self, config: StorageConfig) -> None:
        prom = _prometheus()
        self.config = config
        self.backend_name = config.backend
        self.store_id = str(next(_store_ids))
        self._lock = threading.Lock()
        self._pools: dict[str, _PoolInfo] = {}
        self._prefixes: dict[str, tuple[str, int, int]] = {}  # key prefix -> (pool, component, nbytes)
        self._unknown: set[str] = set()  # prefixes of keys in another scheme
        self._pages: Counter[tuple[str, str]] = Counter()  # (pool, read|write)
        self._bytes: Counter[tuple[str, str]] = Counter()
        self._failed: Counter[tuple[str, str]] = Counter()  # (pool, get|set)
        self._exists: Counter[tuple[str, str]] = Counter()  # (pool, hit|miss)
        self._exists_calls = 0
        self._latency: dict[tuple[str, str], _Histogram] = {}  # (op, v1|v2)
        self._errors: Counter[tuple[str, str]] = Counter()  # (op, exception type)
        self._internal_errors = 0
        self._draft: DraftIo | None = None
        self._backend: weakref.ReferenceType[Any] | None = None
        self.registry = prom.CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))
        _LIVE.add(self)
        port = os.environ.get(PORT_ENV, "").strip()
        if port:
            start_exporter(_parse_port(port), os.environ.get(ADDR_ENV, "").strip() or "127.0.0.1")

    # -------------------------------------------------------------- binding
    def bind_store(self, store: Store) -> None:
        """Let the extension read the backend's ``integrity_errors`` (called by the store)."""
        try:
            self._backend = weakref.ref(store.backend)
        except TypeError:  # a backend without __weakref__ support
            backend = store.backend
            self._backend = lambda: backend  # type: ignore[assignment]

    @property
    def integrity_errors(self) -> int | None:
        """The backend's ``integrity_errors`` counter, or ``None`` (not bound / not reported)."""
        backend = self._backend() if self._backend is not None else None
        value = getattr(backend, "integrity_errors", None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    # ---------------------------------------------------------------- hooks
    @hookimpl(wrapper=True)
    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> Generator[None, Any, Any]:
        result = yield
        try:
            info = _PoolInfo(tuple(pool.components), tuple(int(n) for n in pool.component_nbytes))
            name = PoolName(pool_name)
            with self._lock:
                if self._pools.get(name.value) != info:
                    self._prefixes = {p: v for p, v in self._prefixes.items() if v[0] != name.value}
                    self._unknown.clear()
                self._pools[name.value] = info
        except Exception:  # pragma: no cover - never let metrics break a store
            self._internal_error("register_pool")
        return result

    @hookimpl(wrapper=True)
    def hicache_draft_io_capability(self) -> Generator[None, Any, Any]:
        result = yield
        if isinstance(result, DraftIo):
            self._draft = result
        return result

    @hookimpl(wrapper=True)
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None
    ) -> Generator[None, Any, Any]:
        t0 = time.perf_counter()
        try:
            result = yield
        except BaseException as err:
            self._failure(op, "v1", err, time.perf_counter() - t0)
            raise
        elapsed = time.perf_counter() - t0
        try:
            self._account_v1(op, keys, buffers, result, elapsed)
        except Exception:
            self._internal_error("batch_io_v1")
        return result

    @hookimpl(wrapper=True)
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> Generator[None, Any, Any]:
        t0 = time.perf_counter()
        try:
            result = yield
        except BaseException as err:
            self._failure(op, "v2", err, time.perf_counter() - t0)
            raise
        elapsed = time.perf_counter() - t0
        try:
            self._account_v2(op, transfers, result, elapsed)
        except Exception:
            self._internal_error("batch_io_v2")
        return result

    # ----------------------------------------------------------- accounting
    def _prefix(self, prefix: str) -> tuple[str, int, int] | None:
        """``(pool, component index, bytes)`` of a key prefix ``{ns}.{pool}.{component}.{ranks}.``."""
        info = self._prefixes.get(prefix)
        if info is not None or prefix in self._unknown:
            return info
        parts = prefix.split(".")
        pool = self._pools.get(parts[1]) if len(parts) == 5 and not parts[4] else None
        if pool is not None and parts[2] in pool.components:
            j = pool.components.index(parts[2])
            info = self._prefixes[prefix] = (parts[1], j, pool.component_nbytes[j])
        else:
            if len(self._unknown) > 4096:
                self._unknown.clear()
            self._unknown.add(prefix)
        return info

    def _failure(self, op: Any, path: str, err: BaseException, elapsed: float) -> None:
        opname = str(getattr(op, "value", op))
        with self._lock:
            self._errors[opname, type(err).__name__] += 1
            self._observe(opname, path, elapsed)

    def _observe(self, op: str, path: str, elapsed: float) -> None:
        hist = self._latency.get((op, path))
        if hist is None:
            hist = self._latency[op, path] = _Histogram()
        hist.observe(elapsed)

    def _contract_ok(
        self, op: IoOp, path: str, result: Any, n: int, elapsed: float, flags: bool = True
    ) -> bool:
        # O(1) type probe: a list of ints only partly bool is rejected by the store's own check
        if type(result) is list and len(result) == n and (not flags or not n or _bools(result)):
            return True
        with self._lock:
            self._errors[op.value, "BackendContractError"] += 1
            self._observe(op.value, path, elapsed)
        return False

    def _blocks(self, keys: Sequence[str]) -> list[tuple[str, int, int, tuple[int, ...]]] | None:
        """Pool blocks ``(pool, start, stop, component sizes)`` of a batch in the controller's order.

        The controller lays a v1 batch out pool by pool, page by page, components in pool order.
        Block ends are found by bisection (O(log n) key lookups per pool) and spot-checked; any
        other order returns ``None`` and the batch is counted key by key.
        """
        k0 = keys[0]
        cut = len(k0) - k0.rfind(".") - 1
        if cut <= 0:
            return None
        lookup, pools, n = self._prefix, self._pools, len(keys)
        blocks: list[tuple[str, int, int, tuple[int, ...]]] = []
        start = 0
        while start < n and len(blocks) < 8:
            head = lookup(keys[start][:-cut])
            if head is None or head[1] != 0:
                return None
            pool = head[0]
            sizes = pools[pool].component_nbytes
            c = len(sizes)
            lo, hi = start + 1, n  # first index whose key is not in this pool
            last = lookup(keys[-1][:-cut])
            if last is not None and last[0] == pool:
                lo = hi = n  # the common case: one pool up to the end
            while lo < hi:
                mid = (lo + hi) // 2
                info = lookup(keys[mid][:-cut])
                if info is not None and info[0] == pool:
                    lo = mid + 1
                else:
                    hi = mid
            if (lo - start) % c:
                return None
            for j in range(c):  # spot checks: first and last page carry every component in order
                first, last = lookup(keys[start + j][:-cut]), lookup(keys[lo - c + j][:-cut])
                if first is None or last is None or first[:2] != (pool, j) or last[:2] != (pool, j):
                    return None
            blocks.append((pool, start, lo, sizes))
            start = lo
        return blocks if start == n else None

    def _rows_by_key(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, result: list[bool]
    ) -> list[tuple[str, int, int, int]]:
        """Exact per-key count for any key order or scheme: ``(pool, pages, ok pages, ok bytes)``."""
        tally: dict[str, dict[int, list[int]]] = {}
        for i, key in enumerate(keys):
            info = self._prefix(key[: key.rfind(".") + 1]) if isinstance(key, str) else None
            if info is None:
                info = (UNKNOWN_POOL, 0, int(buffers[i].numel()) if buffers is not None else 0)
            slot = tally.setdefault(info[0], {}).setdefault(info[1], [0, 0, 0])
            slot[0] += 1
            if result[i]:
                slot[1] += 1
                slot[2] += info[2]
        return [
            (
                pool,
                max(v[0] for v in comps.values()),
                min(v[1] for v in comps.values()),
                sum(v[2] for v in comps.values()),
            )
            for pool, comps in tally.items()
        ]

    def _account_v1(
        self,
        op: IoOp,
        keys: Sequence[str],
        buffers: Sequence[torch.Tensor] | None,
        result: Any,
        elapsed: float,
    ) -> None:
        n = len(keys)
        if not self._contract_ok(op, "v1", result, n, elapsed) or n == 0:
            return
        every = result.count(True) == n
        blocks = self._blocks(keys)
        if blocks is None:
            rows = self._rows_by_key(keys, buffers, result)
        else:
            rows = []
            for pool, start, stop, sizes in blocks:
                c = len(sizes)
                total = (stop - start) // c
                oks = [total] * c if every else [result[start + j : stop : c].count(True) for j in range(c)]
                rows.append((pool, total, min(oks), sum(o * z for o, z in zip(oks, sizes))))
        with self._lock:
            self._observe(op.value, "v1", elapsed)
            if op is _EXISTS:
                self._exists_calls += 1
                for pool, total, ok_pages, _ in rows:
                    self._exists[pool, "hit"] += ok_pages
                    self._exists[pool, "miss"] += total - ok_pages
                return
            direction = _DIRECTION[op]
            for pool, total, ok_pages, ok_bytes in rows:
                self._pages[pool, direction] += ok_pages
                self._bytes[pool, direction] += ok_bytes
                self._failed[pool, op.value] += total - ok_pages

    def _account_v2(self, op: IoOp, transfers: Sequence[PoolTransfer], result: Any, elapsed: float) -> None:
        if not self._contract_ok(op, "v2", result, len(transfers), elapsed, flags=False):
            return
        rows = []
        for t, flags in zip(transfers, result):
            n = len(t)
            if not (type(flags) is list and len(flags) == n and (not n or _bools(flags))):
                self._contract_ok(op, "v2", None, n, elapsed)
                return
            info = self._pools.get(t.pool.value)
            rows.append((t.pool.value, n, flags.count(True), info.page_nbytes if info else 0))
        with self._lock:
            self._observe(op.value, "v2", elapsed)
            if op is _EXISTS:
                self._exists_calls += 1
                for pool, n, ok, _ in rows:
                    self._exists[pool, "hit"] += ok
                    self._exists[pool, "miss"] += n - ok
                return
            direction = _DIRECTION[op]
            for pool, n, ok, page_nbytes in rows:
                self._pages[pool, direction] += ok
                self._bytes[pool, direction] += ok * page_nbytes
                self._failed[pool, op.value] += n - ok

    def _internal_error(self, where: str) -> None:
        self._internal_errors += 1
        log.debug("hicache metrics: accounting failed in %s (result passed through)", where, exc_info=True)

    # --------------------------------------------------------------- reading
    def draft_state(self) -> dict[str, Any] | None:
        """``{"declared", "enabled", "reason"}`` once the controller resolved draft offload."""
        declared = self._draft
        if declared is None:
            return None
        enabled = PoolName.DRAFT.value in self._pools
        if enabled:
            reason = declared.reason
        elif declared.mode is DraftIoMode.UNSUPPORTED:
            reason = declared.reason or "the backend declares draft I/O unsupported"
        elif declared.mode is DraftIoMode.ZERO_COPY_V2 and self.config.should_split_heads:
            reason = "should_split_heads=True is incompatible with zero-copy v2 draft I/O"
        else:
            reason = (
                f"the controller could not bind {declared.mode.value} draft I/O (see the hicache warning)"
            )
        return {"declared": declared.mode.value, "enabled": enabled, "reason": reason}

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy of every metric (for tests, ``hicache bench --metrics`` and logs)."""
        with self._lock:
            pages, nbytes, failed = dict(self._pages), dict(self._bytes), dict(self._failed)
            exists, errors = dict(self._exists), dict(self._errors)
            latency = {
                k: (h.count, h.total, [h.quantile(q) for q in (0.5, 0.9, 0.99)])
                for k, h in self._latency.items()
            }
            calls = self._exists_calls
        names = sorted({k[0] for d in (pages, nbytes, failed, exists) for k in d} | set(self._pools))
        pools: dict[str, dict[str, Any]] = {}
        for p in names:
            hits, misses = exists.get((p, "hit"), 0), exists.get((p, "miss"), 0)
            pools[p] = {
                "pages_read": pages.get((p, "read"), 0),
                "bytes_read": nbytes.get((p, "read"), 0),
                "pages_written": pages.get((p, "write"), 0),
                "bytes_written": nbytes.get((p, "write"), 0),
                "failed_get": failed.get((p, "get"), 0),
                "failed_set": failed.get((p, "set"), 0),
                "exists_hits": hits,
                "exists_misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else None,
            }
        err_out: dict[str, dict[str, int]] = {}
        for (op, typ), c in sorted(errors.items()):
            err_out.setdefault(op, {})[typ] = c
        return {
            "backend": self.backend_name,
            "store": self.store_id,
            "pools": pools,
            "totals": {
                key: sum(v[key] for v in pools.values())
                for key in (
                    "pages_read",
                    "bytes_read",
                    "pages_written",
                    "bytes_written",
                    "exists_hits",
                    "exists_misses",
                )
            },
            "exists_calls": calls,
            "latency": {
                f"{op}/{path}": {
                    "count": count,
                    "sum_s": total,
                    **{f"p{q}_ms": None if v is None else v * 1e3 for q, v in zip((50, 90, 99), qs)},
                }
                for (op, path), (count, total, qs) in sorted(latency.items())
            },
            "errors": err_out,
            "integrity_errors": self.integrity_errors,
            "draft": self.draft_state(),
            "internal_errors": self._internal_errors,
        }

    def collect(self) -> Iterator[Any]:
        """Prometheus metric families of this store (used by the registry's collector)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        base = [self.backend_name, self.store_id]
        names = ["backend", "store"]
        with self._lock:
            pages, nbytes, failed = dict(self._pages), dict(self._bytes), dict(self._failed)
            exists, errors, calls = dict(self._exists), dict(self._errors), self._exists_calls
            hists = {k: (list(h.counts), h.total) for k, h in self._latency.items()}
        for name, doc, extra, values in (
            ("pages", "Pages moved, per pool and direction", ["pool", "direction"], pages),
            ("bytes", "Bytes moved, per pool and direction", ["pool", "direction"], nbytes),
            ("failed_pages", "Pages a get/set reported failed", ["pool", "op"], failed),
            ("exists_pages", "Existence checks per pool: hit or miss", ["pool", "result"], exists),
            ("errors", "Backend call failures by exception type", ["op", "type"], errors),
        ):
            fam = CounterMetricFamily(f"hicache_storage_{name}", doc, labels=[*names, *extra])
            for labels, v in sorted(values.items()):
                fam.add_metric([*base, *labels], v)
            yield fam
        fam = CounterMetricFamily("hicache_storage_exists_calls", "Backend exists calls", labels=names)
        fam.add_metric(base, calls)
        yield fam
        hist = HistogramMetricFamily(
            "hicache_storage_io_seconds", "Backend call latency", labels=[*names, "op", "path"], unit=""
        )
        for (op, path), (counts, total) in sorted(hists.items()):
            cumulative = list(itertools.accumulate(counts))
            buckets = [(repr(float(b)), float(c)) for b, c in zip(LATENCY_BUCKETS, cumulative)]
            buckets.append(("+Inf", float(cumulative[-1])))
            hist.add_metric([*base, op, path], buckets, total)
        yield hist
        integrity = self.integrity_errors
        if integrity is not None:
            fam = CounterMetricFamily(
                "hicache_storage_integrity_errors", "Stored objects that failed verification", labels=names
            )
            fam.add_metric(base, integrity)
            yield fam
        draft = self.draft_state()
        if draft is not None:
            g = GaugeMetricFamily(
                "hicache_storage_draft_offload_enabled",
                "Draft KV offload (1 on, 0 off)",
                labels=[*names, "mode", "reason"],
            )
            g.add_metric([*base, draft["declared"], draft["reason"]], 1.0 if draft["enabled"] else 0.0)
            yield g


class _Collector:
    """Adapter so a registry collects one extension."""

    def __init__(self, ext: MetricsExtension) -> None:
        self._ext = weakref.ref(ext)

    def collect(self) -> Iterator[Any]:
        ext = self._ext()
        if ext is not None:
            yield from ext.collect()


# ------------------------------------------------------------------ exporter
_LIVE: weakref.WeakSet[MetricsExtension] = weakref.WeakSet()
_exporters: dict[tuple[str, int], int] = {}
_exporter_lock = threading.Lock()


class _ProcessCollector:
    """Every live store of the process, families merged by name (samples differ by ``store``)."""

    def collect(self) -> Iterator[Any]:
        merged: dict[str, Any] = {}
        for ext in list(_LIVE):
            for fam in ext.collect():
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        yield from merged.values()


def _parse_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"{PORT_ENV}={text!r} must be a TCP port number (0-65535; 0 picks a free one)")
    return port


def start_exporter(port: int, addr: str = "127.0.0.1") -> int:
    """Serve every live store's metrics over HTTP on ``addr:port`` (once per process); return the port.

    ``port=0`` picks a free port. Calling again with the same address and port is a no-op.
    """
    prom = _prometheus()
    with _exporter_lock:
        if (addr, port) in _exporters:
            return _exporters[addr, port]
        registry = prom.CollectorRegistry(auto_describe=True)
        registry.register(_ProcessCollector())
        try:
            server, _thread = prom.start_http_server(port, addr=addr, registry=registry)
        except OSError as err:
            raise ConfigError(
                f"cannot start the hicache metrics exporter on {addr}:{port}: {err.strerror or err}; "
                f"choose another {PORT_ENV} or unset it"
            ) from None
        actual = int(server.server_port)
        _exporters[addr, port] = actual
        log.info("hicache metrics exporter listening on http://%s:%d/metrics", addr, actual)
        return actual


def format_summary(snapshot: dict[str, Any]) -> list[str]:
    """Human-readable lines of a :meth:`MetricsExtension.snapshot` (per-pool bytes, hit rate, latency)."""
    lines = [f"storage metrics for backend {snapshot['backend']!r} (store {snapshot['store']})"]
    for pool, v in snapshot["pools"].items():
        rate = "n/a" if v["hit_rate"] is None else f"{100 * v['hit_rate']:.1f}%"
        lines.append(
            f"  {pool:8s} read {v['pages_read']} pages / {v['bytes_read']} B, written {v['pages_written']} "
            f"pages / {v['bytes_written']} B, hit rate {rate}, failed get {v['failed_get']} set {v['failed_set']}"
        )
    for name, v in snapshot["latency"].items():
        qs = ", ".join(f"{q[:-3]} {v[q]:.3f} ms" for q in ("p50_ms", "p90_ms", "p99_ms") if v[q] is not None)
        lines.append(f"  latency {name:10s} n={v['count']} {qs}")
    if snapshot["errors"]:
        lines.append(f"  errors {snapshot['errors']}")
    if snapshot["integrity_errors"] is not None:
        lines.append(f"  integrity errors {snapshot['integrity_errors']}")
    if snapshot["draft"] is not None:
        d = snapshot["draft"]
        lines.append(
            f"  draft offload {'enabled' if d['enabled'] else 'disabled'} ({d['declared']}: {d['reason']})"
        )
    return lines
