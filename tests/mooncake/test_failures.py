"""Failure behaviour on real processes: no master at setup, outages, recovery."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hicache_mooncake import close_idle_connections
from hicache_mooncake.testing import MooncakeStandalone, free_ports
from mooncake_helpers import embedded_options, fill, make_config, make_group, rand_hashes, snapshot, zero

from hicache_core import (
    BackendIOError,
    BackendTimeoutError,
    CacheController,
    HostPoolGroup,
    PoolName,
    open_store,
)

T = TypeVar("T")

# Bound for one controller operation once an outage is noticed: the health monitor (1 s period)
# or the first RPC_FAIL marks the store down, then every batch fails after one TCP probe
# (probe_timeout_s = 0.5 s by default). The bound leaves room for a loaded 2-core machine and
# stays well below Mooncake's own RPC timeout (~4.5 s), which is what a hang would take.
OUTAGE_BOUND_S = 2.5


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def _until(fn: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.25)


def test_setup_without_master_fails_fast_with_typed_error() -> None:
    (port,) = free_ports(1)
    opts = {"master_server_address": f"127.0.0.1:{port}", "setup_timeout_s": 1.5, "load_env": False}
    t0 = time.monotonic()
    with pytest.raises(BackendTimeoutError, match="not reachable") as err:
        open_store(make_config(opts))
    assert time.monotonic() - t0 < 1.5 + 1.0
    assert "MOONCAKE_MASTER" in str(err.value)
    assert isinstance(err.value, BackendIOError) and isinstance(err.value, TimeoutError)


def test_standalone_without_client_fails_fast() -> None:
    (port,) = free_ports(1)
    opts = {
        "standalone_storage": True,
        "client_server_address": f"127.0.0.1:{port}",
        "setup_timeout_s": 1.0,
        "load_env": False,
    }
    t0 = time.monotonic()
    with pytest.raises(BackendTimeoutError, match="mooncake_client"):
        open_store(make_config(opts))
    assert time.monotonic() - t0 < 2.0


def _check_all_missing(ctl: CacheController, group: HostPoolGroup, hashes: list[str]) -> None:
    """During an outage every operation returns quickly and never reports a page it did not move."""
    q, dt = _timed(lambda: ctl.query(hashes))
    assert q.pages == 0 and dt < OUTAGE_BOUND_S, (q, dt)
    got, dt = _timed(lambda: ctl.prefetch(hashes, list(range(len(hashes)))))
    assert got.pages == 0 and not any(f for v in got.per_pool.values() for f in v), got
    assert dt < OUTAGE_BOUND_S
    res, dt = _timed(lambda: ctl.backup(hashes, list(range(len(hashes)))))
    assert res.pages == 0 and not res.ok and dt < OUTAGE_BOUND_S, (res, dt)


def _recover_and_verify(ctl: CacheController, group: HostPoolGroup, hashes: list[str], n: int) -> None:
    src = list(range(n))
    fill(group, 99)
    ref = snapshot(group)
    extra: dict[PoolName | str, Any] | None = {PoolName.MAMBA: [0]} if PoolName.MAMBA in group else None
    _until(lambda: ctl.backup(hashes, src, extra).pages == n, 30.0, "backup after restart")
    zero(group)
    assert ctl.query(hashes).pages == n
    dst = [group.anchor.num_pages - 1 - i for i in range(n)]
    assert ctl.prefetch(hashes, dst, {PoolName.MAMBA: [3]} if extra else None).pages == n
    if extra:
        for buf, rb in zip(group[PoolName.MAMBA].buffers(), ref[PoolName.MAMBA]):
            assert bool((buf[3] == rb[0]).all())
    for buf, rb in zip(group.anchor.buffers(), ref[PoolName.KV]):
        for s, d in zip(src, dst):
            assert bool((buf[d] == rb[s]).all())


def test_master_outage_and_recovery_embedded(mooncake_master_factory: Any) -> None:
    master = mooncake_master_factory()
    group = make_group("mha")
    n = 8
    with CacheController(make_config(embedded_options(master)), group) as ctl:
        fill(group, 5)
        hashes = rand_hashes(n)
        assert ctl.backup(hashes, list(range(n))).pages == n
        master.kill()
        time.sleep(1.5)  # the health monitor notices within its 1 s period
        for _ in range(3):
            _check_all_missing(ctl, group, hashes)
        master.restart()
        # the master keeps no state: old pages are gone, new backups work again
        _recover_and_verify(ctl, group, hashes, n)


def test_outages_and_recovery_standalone() -> None:
    """Kill the real client, then the master, under a dummy client; recover from both.

    After a mooncake_client restart the dummy client re-registers ALL of the process's shared
    memory with the new client; Mooncake 0.3.13 fails that while another dummy connection of
    the process (to another cluster) is open, so idle shared connections are closed first.
    """
    close_idle_connections()
    n = 6
    with MooncakeStandalone(global_segment_size="64MB") as cluster:
        group = make_group("mamba")
        with CacheController(make_config(cluster.options(load_env=False), "mamba"), group) as ctl:
            hashes = rand_hashes(n)
            fill(group, 1)
            assert ctl.backup(hashes, list(range(n)), {PoolName.MAMBA: [0]}).pages == n
            cluster.client.kill()
            time.sleep(1.5)  # the health monitor notices within its 1 s period
            _check_all_missing(ctl, group, hashes)
            cluster.client.restart()
            _recover_and_verify(ctl, group, rand_hashes(n), n)
            cluster.master.kill()
            time.sleep(1.5)
            _check_all_missing(ctl, group, hashes)
            cluster.master.restart()
            try:
                _recover_and_verify(ctl, group, rand_hashes(n), n)
            except AssertionError as err:
                raise AssertionError(
                    f"{err}\n--- mooncake_client log:\n{cluster.client.log_tail(6000)}\n"
                    f"--- master log:\n{cluster.master.log_tail(3000)}"
                ) from None
