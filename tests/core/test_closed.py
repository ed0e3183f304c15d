"""Every operation on a closed CacheController raises ClosedError (a ValueError, as I/O on a
closed file), synchronous or not, and moves no page."""

from __future__ import annotations

import pytest

import hicache_core as hc


def test_operations_after_close_raise_closed_error(tmp_path) -> None:
    kv = hc.MHAKVPool(num_pages=4, page_size=4, num_layers=1, num_heads=1, head_dim=8)
    ctl = hc.CacheController(
        hc.StorageConfig(backend="file", options={"root": str(tmp_path)}), hc.HostPoolGroup(kv)
    )
    hashes = hc.page_hashes(list(range(8)), page_size=4)
    assert ctl.backup(hashes, [0, 1]).pages == 2
    ctl.close()
    ctl.close()  # idempotent
    calls = {
        "backup": lambda: ctl.backup(hashes, [0, 1]),
        "backup_async": lambda: ctl.backup_async(hashes, [0, 1]),
        "prefetch": lambda: ctl.prefetch(hashes, [2, 3]),
        "prefetch_async": lambda: ctl.prefetch_async(hashes, [2, 3]),
        "query": lambda: ctl.query(hashes),
        "query_async": lambda: ctl.query_async(hashes),
    }
    for name, call in calls.items():
        with pytest.raises(hc.ClosedError, match="closed") as info:
            call()
        assert isinstance(info.value, ValueError), name
