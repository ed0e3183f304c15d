"""README: with the metrics extension, ``controller.store.extensions["metrics"].snapshot()`` gives the counters."""

from __future__ import annotations

import json
from pathlib import Path

import hicache_core as hc


def test_controller_users_read_counters_as_the_readme_says(tmp_path: Path) -> None:
    cfg = hc.StorageConfig(
        backend="file", options={"root": str(tmp_path)}, model_name="m", extensions=["metrics"]
    )
    kv = hc.MHAKVPool(8, 4, 1, 1, 8)
    with hc.CacheController(cfg, kv) as ctl:
        hashes = hc.page_hashes(list(range(16)), 4)
        assert ctl.backup(hashes, [0, 1, 2, 3]).pages == 4
        assert ctl.prefetch(hashes, [4, 5, 6, 7]).pages == 4
        snap = ctl.store.extensions["metrics"].snapshot()  # type: ignore[attr-defined]
    json.dumps(snap)  # JSON-ready
    assert {"pools", "totals", "latency", "errors"} <= set(snap)
    assert snap["totals"]["pages_written"] == 4 and snap["totals"]["pages_read"] == 4
    kv_counts = snap["pools"]["kv"]
    assert {"pages_read", "bytes_read", "pages_written", "bytes_written", "failed_get", "failed_set"} <= set(
        kv_counts
    )
    assert kv_counts["bytes_written"] == kv_counts["bytes_read"] > 0
