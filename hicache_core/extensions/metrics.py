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

Counting is per call, with no Python loop over pages (but see the last case). A v2 call is
counted per transfer with ``len()``, ``list.count`` and the pool's page size. A v1 call carries
the keys of the one pool named by its ``pool_name`` argument, page by page with each page's
components in pool order; when only some keys succeeded, each component's results are a list
slice and a page counts as moved when all of its components did. Bytes are those the backend
reported moved (a ``set`` skipped because the page already existed counts as written), at the
component sizes the pool declared when it was registered. A v1 call whose keys are not whole
pages of a registered pool counts each key as a page of its buffer's size. A call abandoned by
the controller's ``io_timeout_s`` is recorded when it finally returns.

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
import errno
import itertools
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..env import env_str
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
_DIRECTION = {"get": "read", "set": "write"}
_CONTRACT = "BackendContractError"
_SEQUENCES = (list, tuple)  # the result types the store accepts from an I/O hook
_store_ids = itertools.count()

_Row = tuple[str, int, int, int]
"""What one call did to one pool: ``(pool, pages, pages done, bytes moved)``."""


def _flags_ok(flags: Any, n: int) -> bool:
    """``n`` bools in a list or tuple, as the store accepts. The type probe looks at the ends only
    (O(1)): a list only partly bool is refused by the store's own check after this wrapper."""
    return (
        type(flags) in _SEQUENCES and len(flags) == n and (not n or type(flags[0]) is type(flags[-1]) is bool)
    )


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as err:
        raise BackendUnavailableError(
            f"the 'metrics' extension needs prometheus_client ({err}); install it with `{INSTALL_HINT}` "
            "or remove 'metrics' from extensions / set enable_storage_metrics=False"
        ) from None
    return prometheus_client


class _Histogram:
    """Non-cumulative bucket counts (the last one is +Inf) and the sum of observations."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds


def _quantile(counts: list[int], q: float) -> float | None:
    """Estimate by linear interpolation inside the bucket (as Prometheus' histogram_quantile)."""
    rank, seen = q * sum(counts), 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            lo = LATENCY_BUCKETS[i - 1] if i > 0 else 0.0
            hi = LATENCY_BUCKETS[i] if i < len(LATENCY_BUCKETS) else LATENCY_BUCKETS[-1]
            return lo + (hi - lo) * (rank - seen) / c
        seen += c
    return None  # no observations


class MetricsExtension:
    """Records storage metrics of one store; see the module docstring."""

    def __init__(self, config: StorageConfig) -> None:
        prom = _prometheus()
        self.config = config
        self.backend_name = config.backend
        self.store_id = str(next(_store_ids))
        self._lock = threading.Lock()
        self._pools: dict[str, tuple[int, ...]] = {}  # pool -> bytes of each page component
        self._pages: Counter[tuple[str, str]] = Counter()  # (pool, read|write)
        self._bytes: Counter[tuple[str, str]] = Counter()
        self._failed: Counter[tuple[str, str]] = Counter()  # (pool, get|set)
        self._exists: Counter[tuple[str, str]] = Counter()  # (pool, hit|miss)
        self._exists_calls = 0
        self._latency: dict[tuple[str, str], _Histogram] = {}  # (op, v1|v2)
        self._errors: Counter[tuple[str, str]] = Counter()  # (op, exception type)
        self._internal_errors = 0
        self._draft: DraftIo | None = None
        self._backend: Callable[[], Any] | None = None
        self.registry = prom.CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))
        _LIVE.add(self)
        port = env_str(PORT_ENV)
        if port:
            start_exporter(_parse_port(port), env_str(ADDR_ENV))

    # -------------------------------------------------------------- binding
    def bind_store(self, store: Store) -> None:
        """Let the extension read the backend's ``integrity_errors`` (called by the store)."""
        backend = store.backend
        try:
            self._backend = weakref.ref(backend)
        except TypeError:  # a backend without __weakref__ support
            self._backend = lambda: backend

    @property
    def integrity_errors(self) -> int | None:
        """The backend's ``integrity_errors`` counter, or ``None`` (not bound / not reported)."""
        backend = self._backend() if self._backend is not None else None
        value = getattr(backend, "integrity_errors", None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    # ---------------------------------------------------------------- hooks
    @hookimpl(wrapper=True)
    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> Generator[None, Any, Any]:
        result = yield  # a pool the backend refuses (it raises) is not recorded
        try:
            self._pools[PoolName(pool_name).value] = tuple(int(n) for n in pool.component_nbytes)
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
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> Generator[None, Any, Any]:
        return (yield from self._timed(op, "v1", lambda r: self._rows_v1(pool_name, keys, buffers, r)))

    @hookimpl(wrapper=True)
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> Generator[None, Any, Any]:
        return (yield from self._timed(op, "v2", lambda r: self._rows_v2(transfers, r)))

    # ----------------------------------------------------------- accounting
    def _timed(
        self, op: IoOp, path: str, rows_of: Callable[[Any], list[_Row] | None]
    ) -> Generator[None, Any, Any]:
        """Time one I/O call and record it; its result or exception passes through unchanged.

        ``rows_of(result)`` says what the call did per pool, or ``None`` for a result that breaks
        the contract.
        """
        opname = str(getattr(op, "value", op))
        t0 = time.perf_counter()
        try:
            result = yield
        except BaseException as err:
            self._record(opname, path, time.perf_counter() - t0, (), type(err).__name__)
            raise
        elapsed = time.perf_counter() - t0
        try:
            rows = rows_of(result)
            if rows is None:
                self._record(opname, path, elapsed, (), _CONTRACT)
            else:
                self._record(opname, path, elapsed, rows, None)
        except Exception:
            self._internal_error(f"batch_io_{path}")
        return result

    def _rows_v1(
        self, pool_name: PoolName, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, result: Any
    ) -> list[_Row] | None:
        n = len(keys)
        if not _flags_ok(result, n):
            return None
        if not n:
            return []
        pool = str(getattr(pool_name, "value", pool_name))
        done = result.count(True)
        sizes = self._pools.get(pool)
        if sizes is None or n % len(sizes):  # not whole pages of a registered pool: a page per key
            moved = sum(int(b.numel()) for b, ok in zip(buffers, result) if ok) if buffers else 0
            return [(pool, n, done, moved)]
        c = len(sizes)
        pages = n // c
        if done == n:
            return [(pool, pages, pages, pages * sum(sizes))]
        if done == 0 or c == 1:
            return [(pool, pages, done, done * sizes[0])]
        per_component = [result[j::c] for j in range(c)]
        return [
            (
                pool,
                pages,
                sum(map(all, zip(*per_component))),  # pages whose every component succeeded
                sum(flags.count(True) * size for flags, size in zip(per_component, sizes)),
            )
        ]

    def _rows_v2(self, transfers: Sequence[PoolTransfer], result: Any) -> list[_Row] | None:
        if type(result) not in _SEQUENCES or len(result) != len(transfers):
            return None
        rows = []
        for t, flags in zip(transfers, result):
            n = len(t)
            if not _flags_ok(flags, n):
                return None
            done = flags.count(True)
            rows.append((t.pool.value, n, done, done * sum(self._pools.get(t.pool.value, ()))))
        return rows

    def _record(self, op: str, path: str, elapsed: float, rows: Sequence[_Row], error: str | None) -> None:
        """Count one call: its latency, then its error or what it did per pool."""
        with self._lock:
            hist = self._latency.get((op, path))
            if hist is None:
                hist = self._latency[op, path] = _Histogram()
            hist.observe(elapsed)
            if error is not None:
                self._errors[op, error] += 1
            elif op == "exists":
                self._exists_calls += 1
                for pool, pages, done, _ in rows:
                    self._exists[pool, "hit"] += done
                    self._exists[pool, "miss"] += pages - done
            else:
                direction = _DIRECTION[op]
                for pool, pages, done, moved in rows:
                    self._pages[pool, direction] += done
                    self._bytes[pool, direction] += moved
                    self._failed[pool, op] += pages - done

    def _internal_error(self, where: str) -> None:
        self._internal_errors += 1
        log.debug("hicache metrics: accounting failed in %s (result passed through)", where, exc_info=True)

    # --------------------------------------------------------------- reading
    def _state(self) -> dict[str, Any]:
        """A consistent copy of every counter, keyed by metric family name."""
        with self._lock:
            return {
                "pages": dict(self._pages),
                "bytes": dict(self._bytes),
                "failed_pages": dict(self._failed),
                "exists_pages": dict(self._exists),
                "errors": dict(self._errors),
                "exists_calls": self._exists_calls,
                "latency": {k: (list(h.counts), h.total) for k, h in self._latency.items()},
            }

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
        s = self._state()
        pages, nbytes, failed, exists = s["pages"], s["bytes"], s["failed_pages"], s["exists_pages"]
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
        totals = "pages_read bytes_read pages_written bytes_written exists_hits exists_misses".split()
        errors: dict[str, dict[str, int]] = {}
        for (op, typ), c in sorted(s["errors"].items()):
            errors.setdefault(op, {})[typ] = c
        latency: dict[str, dict[str, Any]] = {}
        for (op, path), (counts, total) in sorted(s["latency"].items()):
            entry = latency[f"{op}/{path}"] = {"count": sum(counts), "sum_s": total}
            for q in (50, 90, 99):
                seconds = _quantile(counts, q / 100)
                entry[f"p{q}_ms"] = None if seconds is None else seconds * 1e3
        return {
            "backend": self.backend_name,
            "store": self.store_id,
            "pools": pools,
            "totals": {key: sum(v[key] for v in pools.values()) for key in totals},
            "exists_calls": s["exists_calls"],
            "latency": latency,
            "errors": errors,
            "integrity_errors": self.integrity_errors,
            "draft": self.draft_state(),
            "internal_errors": self._internal_errors,
        }

    def collect(self) -> Iterator[Any]:
        """Prometheus metric families of this store (used by the registry's collector)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        base = [self.backend_name, self.store_id]
        names = ["backend", "store"]
        s = self._state()
        for name, doc, extra in (
            ("pages", "Pages moved, per pool and direction", ["pool", "direction"]),
            ("bytes", "Bytes moved, per pool and direction", ["pool", "direction"]),
            ("failed_pages", "Pages a get/set reported failed", ["pool", "op"]),
            ("exists_pages", "Existence checks per pool: hit or miss", ["pool", "result"]),
            ("errors", "Backend call failures by exception type", ["op", "type"]),
        ):
            fam = CounterMetricFamily(f"hicache_storage_{name}", doc, labels=[*names, *extra])
            for labels, v in sorted(s[name].items()):
                fam.add_metric([*base, *labels], v)
            yield fam
        fam = CounterMetricFamily("hicache_storage_exists_calls", "Backend exists calls", labels=names)
        fam.add_metric(base, s["exists_calls"])
        yield fam
        hist = HistogramMetricFamily(
            "hicache_storage_io_seconds", "Backend call latency", labels=[*names, "op", "path"], unit=""
        )
        for (op, path), (counts, total) in sorted(s["latency"].items()):
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
        except OSError as err:  # the port is taken, or the address is not one of this host's
            fix = (
                f"choose another {PORT_ENV} (0 picks a free one)"
                if err.errno == errno.EADDRINUSE
                else f"set {ADDR_ENV} to an address of this host (default 127.0.0.1)"
            )
            raise ConfigError(
                f"cannot start the hicache metrics exporter on {addr}:{port}: {err.strerror or err}; "
                f"{fix}, or unset {PORT_ENV}"
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
