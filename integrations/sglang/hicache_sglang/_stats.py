"""SGLang ``get_stats()`` from the hicache ``metrics`` extension.

SGLang's scheduler calls ``storage_backend.get_stats()`` periodically when storage metrics are
enabled and logs each returned list into histograms (``StorageMetrics``: pages per prefetch and
backup, and their bandwidth in GB/s). The adapter reports, per call, what the metrics extension
counted since the previous call: one entry for reads and one for writes, with the bandwidth
computed from the bytes moved and the backend time spent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StatsDelta", "StorageStats", "storage_metrics_class"]


@dataclass
class StorageStats:
    """Same fields as SGLang's ``StorageMetrics`` (used when SGLang's class cannot be imported)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def storage_metrics_class() -> type:
    """SGLang's ``StorageMetrics`` (its collector asserts that type), else :class:`StorageStats`.

    ``sglang.srt.observability.metrics_collector`` pulls in ``transformers``; a running SGLang
    server always has it, a light test environment may not.
    """
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except Exception:
        return StorageStats
    return StorageMetrics  # type: ignore[no-any-return]


def _totals(snapshot: dict[str, Any]) -> dict[str, float]:
    totals = snapshot.get("totals", {})
    latency = snapshot.get("latency", {})
    return {
        "pages_read": float(totals.get("pages_read", 0)),
        "bytes_read": float(totals.get("bytes_read", 0)),
        "pages_written": float(totals.get("pages_written", 0)),
        "bytes_written": float(totals.get("bytes_written", 0)),
        "get_s": sum(float(v["sum_s"]) for k, v in latency.items() if k.startswith("get/")),
        "set_s": sum(float(v["sum_s"]) for k, v in latency.items() if k.startswith("set/")),
    }


class StatsDelta:
    """Turns cumulative metrics snapshots into SGLang's per-interval ``StorageMetrics``."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, snapshot: dict[str, Any]) -> Any:
        now = _totals(snapshot)
        d = {k: now[k] - self._last.get(k, 0.0) for k in now}
        self._last = now
        stats = storage_metrics_class()()
        if d["pages_read"] > 0:
            stats.prefetch_pgs.append(int(d["pages_read"]))
            stats.prefetch_bandwidth.append(d["bytes_read"] / d["get_s"] / 1e9 if d["get_s"] > 0 else 0.0)
        if d["pages_written"] > 0:
            stats.backup_pgs.append(int(d["pages_written"]))
            stats.backup_bandwidth.append(d["bytes_written"] / d["set_s"] / 1e9 if d["set_s"] > 0 else 0.0)
        return stats
