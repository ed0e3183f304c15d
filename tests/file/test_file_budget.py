"""``max_bytes``: LRU eviction, the index rebuilt on open, stale temp files swept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from file_helpers import config, files_under
from hicache_file._format import header_size

from hicache_core import IoOp, Store, open_store

N = 1000
KEYLEN = len("b.p.000")
DISK = header_size(KEYLEN) + N  # header (fixed part, key, padding to 64) + payload


def _keys(lo: int, hi: int) -> list[str]:
    return [f"b.p.{i:03d}" for i in range(lo, hi)]


def _set(store: Store, keys: list[str]) -> list[bool]:
    return store.batch_io_v1(
        IoOp.SET, keys, [torch.full((N,), i % 256, dtype=torch.uint8) for i in range(len(keys))]
    )


def _present(store: Store, keys: list[str]) -> list[bool]:
    return store.batch_io_v1(IoOp.EXISTS, keys)


def _disk_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for f in files_under(root))


def test_lru_eviction_keeps_recently_used(tmp_path: Path) -> None:
    budget = 10 * DISK
    with open_store(config(tmp_path, options={"max_bytes": budget})) as store:
        backend = store.backend
        assert _set(store, _keys(0, 8)) == [True] * 8
        assert backend.index is not None and backend.index.total_bytes == 8 * DISK
        # touch page 0 so it becomes the most recently used
        assert store.batch_io_v1(IoOp.GET, _keys(0, 1), [torch.zeros(N, dtype=torch.uint8)]) == [True]
        assert _set(store, _keys(8, 12)) == [True] * 4  # 12 pages > budget -> evict 2 LRU
        assert _disk_bytes(tmp_path) <= budget
        assert _present(store, _keys(0, 4)) == [True, False, False, True]
        assert all(_present(store, _keys(3, 12)))
        stats = backend.stats
        assert stats.evictions == 2 and stats.evicted_bytes == 2 * DISK
        # one batch bigger than the whole budget: the tail of the batch survives
        assert _set(store, _keys(20, 35)) == [True] * 15
        assert _disk_bytes(tmp_path) <= budget
        assert all(_present(store, _keys(25, 35)))


def test_index_survives_restart_and_smaller_budget_evicts_oldest(tmp_path: Path) -> None:
    with open_store(config(tmp_path, options={"max_bytes": 100 * DISK})) as store:
        for i in range(0, 20, 5):
            assert all(_set(store, _keys(i, i + 5)))
            time.sleep(0.01)  # distinct modification times per batch
    with open_store(config(tmp_path, options={"max_bytes": 100 * DISK})) as store:
        assert len(store.backend.index) == 20
        assert store.backend.index.total_bytes == 20 * DISK == _disk_bytes(tmp_path)
    with open_store(config(tmp_path, options={"max_bytes": 12 * DISK})) as store:
        assert store.backend.stats.evictions == 8
        assert _present(store, _keys(0, 20)) == [False] * 8 + [True] * 12
    assert _disk_bytes(tmp_path) == 12 * DISK


def test_page_larger_than_budget_is_refused(tmp_path: Path) -> None:
    with open_store(config(tmp_path, options={"max_bytes": DISK - 1})) as store:
        assert _set(store, _keys(0, 1)) == [False]
        assert store.backend.stats.write_errors == 1
    assert files_under(tmp_path) == []


def test_stale_temp_files_are_swept_on_open(tmp_path: Path) -> None:
    with open_store(config(tmp_path)) as store:
        assert all(_set(store, _keys(0, 2)))
        leaf = os.path.dirname(store.backend.path_of(_keys(0, 1)[0]))
    old, young = os.path.join(leaf, ".tmp-dead-1-0"), os.path.join(leaf, ".tmp-live-2-0")
    for p in (old, young):
        with open(p, "wb") as f:
            f.write(b"partial")
    past = time.time() - 7200
    os.utime(old, (past, past))
    with open_store(config(tmp_path, options={"max_bytes": 10**6, "temp_max_age_s": 3600})) as store:
        assert store.backend.stats.temp_files_removed == 1
        assert len(store.backend.index) == 2, "temp files are never indexed as pages"
    assert not os.path.exists(old) and os.path.exists(young)
    with open_store(config(tmp_path)) as store:
        store.clear()  # the core namespace differs; clear the test namespace directly
        assert store.backend.hicache_clear(namespace="b") == 2
    assert files_under(tmp_path) == []


def test_scan_indexes_only_files_at_their_own_path(tmp_path: Path) -> None:
    with open_store(config(tmp_path)) as store:
        assert all(_set(store, _keys(0, 3)))
        shard = os.path.dirname(store.backend.path_of(_keys(0, 1)[0]))
    stray = [os.path.join(shard, "b.p.elsewhere"), os.path.join(tmp_path, "b", "notes.txt")]
    for p in stray:
        with open(p, "wb") as f:
            f.write(b"x" * 10)
    with open_store(config(tmp_path, options={"max_bytes": DISK})) as store:
        assert len(store.backend.index) == 1, "stray files are never indexed (nor evicted)"
        assert store.backend.stats.evictions == 2
    assert all(os.path.exists(p) for p in stray)
