"""After the controller answers, nothing it started touches the caller's host slots or publishes
a key with other bytes than the ones handed over; hybrid restores hand out the state of exactly
the last usable page (design.md section 5, ARCHITECTURE.md "Ownership of host memory").

Real file backend in a temporary root. The only thing injected is a stall: a wrapper hook
registered in the store's plugin manager holds a backend call before it reaches the backend,
until the test releases it (the real backend then does its real I/O, late), or a corrupt page
file planted on disk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

import hicache_core as hc
from hicache_core import CacheController, HostPoolGroup, IoOp, MambaPool, MHAKVPool, PoolName

SLACK_S = 1.0  # scheduling slack allowed past a deadline on a loaded 2-core machine


class Stall:
    """Holds every I/O hook call whose op is in ``ops`` until :meth:`release`; records when the
    held calls have finished in the backend."""

    def __init__(self, *ops: IoOp) -> None:
        self.ops = {IoOp(o) for o in ops}
        self.gate = threading.Event()
        self.held = 0
        self.finished = threading.Event()
        self.lock = threading.Lock()

    def _hold(self, op: Any) -> bool:
        if IoOp(op) not in self.ops:
            return False
        with self.lock:
            self.held += 1
        self.gate.wait(30)
        return True

    def _around(self, op: Any) -> Generator[None, Any, Any]:
        held = self._hold(op)
        try:
            return (yield)
        finally:
            if held:
                self.finished.set()

    @hc.hookimpl(wrapper=True)
    def hicache_batch_io_v1(self, op: Any) -> Generator[None, Any, Any]:
        return (yield from self._around(op))

    @hc.hookimpl(wrapper=True)
    def hicache_batch_io_v2(self, op: Any) -> Generator[None, Any, Any]:
        return (yield from self._around(op))

    def release(self) -> None:
        self.gate.set()


def _hashes(n: int, seed: int = 0) -> list[str]:
    return hc.page_hashes(list(range(seed, seed + 4 * n)), 4)


def _kv() -> MHAKVPool:
    return MHAKVPool(16, 4, 2, 2, 8)


def _fill(pool: Any, pages: range | list[int], value: int) -> None:
    for i in pages:
        for view in pool.page_views([i])[0]:
            view.fill_(value)


def _pages_equal(pool: Any, pages: range | list[int], value: int) -> bool:
    return all(bool((v == value).all()) for i in pages for v in pool.page_views([i])[0])


def _config(root: Path, **settings: Any) -> hc.StorageConfig:
    return hc.StorageConfig(backend="file", options={"root": str(root)}, model_name="never-wrong", **settings)


@pytest.fixture
def stall_released() -> Generator[list[Stall], None, None]:
    stalls: list[Stall] = []
    yield stalls
    for s in stalls:
        s.release()


def test_timed_out_backup_never_publishes_the_next_requests_bytes(
    tmp_path: Path, stall_released: list[Stall]
) -> None:
    """Item 1: a backup reported failed by io_timeout_s, whose slots the engine then reuses, never
    publishes the new bytes under the old page's key when the stalled call completes."""
    kv = _kv()
    with CacheController(_config(tmp_path, io_timeout_s=0.3), kv) as ctl:
        old = _hashes(3)
        stall = Stall(IoOp.SET)
        stall_released.append(stall)
        ctl.store.pm.register(stall)
        _fill(kv, range(3), 0x11)
        res = ctl.backup(old, range(3))
        assert res.pages == 0 and any("io_timeout_s" in e for e in res.errors)
        _fill(kv, range(3), 0x77)  # the engine reuses the slots for another request
        stall.release()
        assert stall.finished.wait(10), "the stalled call never completed"
        time.sleep(0.2)
        ctl.store.pm.unregister(stall)
        got = ctl.prefetch(old, range(8, 11))
        assert _pages_equal(kv, range(8, 8 + got.pages), 0x11), (
            "a later prefetch returned the next request's bytes under the old key"
        )


def test_timed_out_prefetch_never_writes_into_freed_slots(
    tmp_path: Path, stall_released: list[Stall]
) -> None:
    """Item 2: after a prefetch is reported failed by io_timeout_s, the stalled read never lands
    in the host slots the engine has freed and reused."""
    kv = _kv()
    with CacheController(_config(tmp_path, io_timeout_s=0.3), kv) as ctl:
        stored = _hashes(3, seed=100)
        _fill(kv, range(3), 0x22)
        assert ctl.backup(stored, range(3)).pages == 3
        stall = Stall(IoOp.GET)
        stall_released.append(stall)
        ctl.store.pm.register(stall)
        res = ctl.prefetch(stored, range(8, 11))
        assert res.pages == 0 and any("io_timeout_s" in e for e in res.errors)
        _fill(kv, range(8, 11), 0x55)  # freed and reused
        stall.release()
        assert stall.finished.wait(10), "the stalled call never completed"
        time.sleep(0.2)
        assert _pages_equal(kv, range(8, 11), 0x55), "the abandoned read wrote into reused host slots"


def test_timeout_policy_meets_its_deadline_when_the_backend_hangs(
    tmp_path: Path, stall_released: list[Stall]
) -> None:
    """Item 3: the `timeout` policy returns within prefetch_timeout_s (+ slack) although the
    backend never answers; what it abandoned never touches the slots afterwards; close() is
    bounded too."""
    kv = _kv()
    cfg = _config(tmp_path, prefetch_policy="timeout", prefetch_timeout_s=0.5, batch_pages=2)
    ctl = CacheController(cfg, kv)
    try:
        stored = _hashes(6, seed=200)
        _fill(kv, range(6), 0x33)
        assert ctl.backup(stored, range(6)).pages == 6
        stall = Stall(IoOp.GET)
        stall_released.append(stall)
        ctl.store.pm.register(stall)
        t0 = time.monotonic()
        handle = ctl.prefetch_async(stored, range(8, 14))
        res = handle.result()
        assert time.monotonic() - t0 < 0.5 + SLACK_S, "the timeout policy missed its deadline"
        assert res.pages == 0
        _fill(kv, range(8, 14), 0x66)
        t1 = time.monotonic()
        ctl.close()
        assert time.monotonic() - t1 < SLACK_S + 5, "close() waited for a hung backend call"
        stall.release()
        assert stall.finished.wait(10)
        time.sleep(0.2)
        assert _pages_equal(kv, range(8, 14), 0x66), "the abandoned prefetch wrote into the slots"
    finally:
        ctl.close()


def test_hybrid_restore_hands_out_the_state_of_the_last_usable_page(tmp_path: Path) -> None:
    """Item 4: KV + Mamba. The KV page after page 3 is corrupt on disk, so only 3 pages are
    usable: the Mamba slot must then hold the state saved after page 3, never the one after
    page 9 (or the restore is reported as 0 pages)."""
    kv = _kv()
    mamba = MambaPool(4, 2, (4, 4), [(3, 4)])
    group = HostPoolGroup(kv, {PoolName.MAMBA: mamba})
    cfg = _config(tmp_path)
    with CacheController(cfg, group) as ctl:
        hs = _hashes(9, seed=300)
        _fill(kv, range(9), 0x44)
        _fill(mamba, [0], 0x03)  # the state after page 3
        assert ctl.backup(hs[:3], range(3), {PoolName.MAMBA: [0]}).pages == 3
        _fill(mamba, [0], 0x09)  # the state after page 9
        assert ctl.backup(hs, range(9), {PoolName.MAMBA: [0]}).pages == 9
        key = ctl.store.page_keys(PoolName.KV, [hs[3]])[0][0]
        (page_file,) = [p for p in tmp_path.rglob(f"*{hs[3]}*") if p.name.startswith(key) or key in p.name]
        data = bytearray(page_file.read_bytes())
        data[-1] ^= 0xFF  # one flipped bit in the payload of page 4's K component
        page_file.write_bytes(bytes(data))
        _fill(mamba, [1], 0x00)
        res = ctl.prefetch(hs, range(9), {PoolName.MAMBA: [1]})
        assert res.pages in (0, 3), res
        if res.pages == 3:
            assert _pages_equal(mamba, [1], 0x03), "the Mamba slot holds the state of a longer prefix"
        q = ctl.query(hs)
        assert q.pages in (0, 3)


def test_hybrid_query_counts_only_prefixes_with_trailing_state(tmp_path: Path) -> None:
    """`query` agrees: KV pages stored up to 9 but Mamba state only after page 3 -> 3."""
    kv = _kv()
    mamba = MambaPool(4, 2, (4, 4), [(3, 4)])
    group = HostPoolGroup(kv, {PoolName.MAMBA: mamba})
    with CacheController(_config(tmp_path), group) as ctl:
        hs = _hashes(9, seed=400)
        _fill(kv, range(9), 0x45)
        assert ctl.backup(hs[:3], range(3), {PoolName.MAMBA: [0]}).pages == 3
        assert ctl.backup(hs, range(9)).pages == 9  # KV only: no state after page 9
        assert ctl.query(hs).pages == 3
        res = ctl.prefetch(hs, range(9), {PoolName.MAMBA: [1]})
        assert res.pages == 3
