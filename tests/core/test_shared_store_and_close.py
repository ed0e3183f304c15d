"""A store shared by controllers, close() against operations in flight, and a failing key hook.

- ``CacheController(config, pools, store=store)``: a config that keys pages differently from the
  store's own is refused, and so is a second, different pool under a name an open controller
  still uses (the backend keeps one pool per name: zero-copy I/O would move the wrong memory).
- ``close()`` waits for synchronous operations running in other threads before it closes the
  store (they move pages straight to and from host memory), and an operation cancelled while
  queued does not keep it waiting.
- A ``hicache_page_keys`` that raises fails the batch's pages (reported, logged), never the call.

Real file backend in a temporary root; the only thing injected is a stall or a raising hook
registered in the store's plugin manager.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

import hicache_core as hc
from hicache_core import CacheController, IoOp, MHAKVPool


def _config(root: Path, **fields: Any) -> hc.StorageConfig:
    return hc.StorageConfig(
        **{"backend": "file", "options": {"root": str(root)}, "model_name": "shared", **fields}
    )


def _kv() -> MHAKVPool:
    return MHAKVPool(8, 4, 1, 1, 8)


HASHES = hc.page_hashes(list(range(16)), 4)


class Gate:
    """Holds every I/O call whose op is ``op`` until released."""

    def __init__(self, op: IoOp) -> None:
        self.op, self.entered, self.gate = op, threading.Event(), threading.Event()

    @hc.hookimpl(wrapper=True)
    def hicache_batch_io_v2(self, op: Any) -> Generator[None, Any, Any]:
        if IoOp(op) is self.op:
            self.entered.set()
            self.gate.wait(30)
        return (yield)

    @hc.hookimpl(wrapper=True)
    def hicache_batch_io_v1(self, op: Any) -> Generator[None, Any, Any]:
        if IoOp(op) is self.op:
            self.entered.set()
            self.gate.wait(30)
        return (yield)


def test_a_shared_store_refuses_a_config_with_other_keys(tmp_path: Path) -> None:
    with hc.open_store(_config(tmp_path)) as store:
        for other in (_config(tmp_path, tp_rank=1, tp_size=2), _config(tmp_path, model_name="other")):
            with pytest.raises(hc.ConfigError, match="differs from the config store") as info:
                CacheController(other, _kv(), store=store)
            assert "model_name" in str(info.value) or "tp_rank" in str(info.value)
        # controller settings are the controller's own
        CacheController(_config(tmp_path, controller={"batch_pages": 2}), _kv(), store=store).close()


def test_a_shared_store_refuses_a_second_pool_under_a_name_in_use(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    kv_a, kv_b = _kv(), _kv()
    with hc.open_store(cfg) as store:
        a = CacheController(cfg, kv_a, store=store)
        with pytest.raises(hc.PoolError, match="already has a different 'kv' pool"):
            CacheController(cfg, kv_b, store=store)
        with CacheController(cfg, kv_a, store=store) as same:  # the same pool may be shared
            assert same.backup(HASHES[:2], [0, 1]).pages == 2
        for i in range(8):
            for view in kv_a.page_views([i])[0]:
                view.fill_(i + 1)
        assert a.backup(HASHES[2:4], [2, 3]).pages == 2
        a.close()
        with CacheController(cfg, kv_b, store=store) as b:  # free again once a is closed
            assert b.prefetch(HASHES[2:4], [5, 6]).pages == 2
            for src, dst in ((2, 5), (3, 6)):
                for x, y in zip(kv_a.page_views([src])[0], kv_b.page_views([dst])[0]):
                    assert bool((x == y).all())


def test_close_waits_for_a_synchronous_operation_in_another_thread(tmp_path: Path) -> None:
    ctl = CacheController(_config(tmp_path), _kv())
    assert ctl.backup(HASHES[:2], [0, 1]).pages == 2
    gate = Gate(IoOp.GET)
    ctl.store.pm.register(gate)
    events: list[str] = []
    reader = threading.Thread(
        target=lambda: events.append(f"prefetch {ctl.prefetch(HASHES[:2], [4, 5]).pages}")
    )
    reader.start()
    assert gate.entered.wait(10)
    closer = threading.Thread(target=lambda: (ctl.close(), events.append("closed")))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() returned while a prefetch was still moving pages"
    gate.gate.set()
    reader.join(10)
    closer.join(10)
    assert events == ["prefetch 2", "closed"]
    assert ctl.store.closed


def test_an_operation_cancelled_while_queued_does_not_hold_up_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _config(tmp_path, controller={"io_threads": 1, "io_timeout_s": 5})
    ctl = CacheController(cfg, _kv())
    gate = Gate(IoOp.SET)
    ctl.store.pm.register(gate)
    first = ctl.backup_async(HASHES[:1], [0])
    assert gate.entered.wait(10)
    queued = ctl.prefetch_async(HASHES[1:2], [1])
    assert queued.cancel()
    gate.gate.set()
    assert first.result(10).pages == 1
    with caplog.at_level(logging.WARNING, logger="hicache"):
        ctl.close(timeout_s=5)
    assert "abandoned" not in caplog.text


def test_closed_controller_and_store_refuse_clear_and_io(tmp_path: Path) -> None:
    ctl = CacheController(_config(tmp_path), _kv())
    store = ctl.store
    ctl.close()
    with pytest.raises(hc.ClosedError):
        ctl.clear()
    with pytest.raises(hc.ClosedError):
        store.clear()
    with pytest.raises(hc.ClosedError):
        store.batch_io_v1("exists", ["k"], None)


class RaisingKeys:
    @hc.hookimpl(tryfirst=True)
    def hicache_page_keys(self, pool_name: Any, page_hashes: Any) -> Any:
        raise RuntimeError("key service down")


def test_a_failing_key_hook_fails_the_pages_not_the_call(tmp_path: Path) -> None:
    for settings in ({}, {"io_timeout_s": 5}):
        ctl = CacheController(_config(tmp_path, controller=settings), _kv())
        ctl.store.pm.register(RaisingKeys())
        with ctl:
            backup = ctl.backup(HASHES[:2], [0, 1])
            assert backup.pages == 0 and backup.errors
            assert ctl.query(HASHES[:2]).pages == 0
            loaded = ctl.prefetch(HASHES[:2], [2, 3])
            assert loaded.pages == 0 and any("key service down" in e for e in loaded.errors)


@pytest.mark.parametrize("settings", [{}, {"io_timeout_s": 10}], ids=["direct", "staged"])
def test_result_timeout_ends_the_prefetch_before_it_raises(tmp_path: Path, settings: dict[str, Any]) -> None:
    kv = _kv()
    ctl = CacheController(_config(tmp_path, controller=settings), kv)
    with ctl:
        for i in range(8):
            for view in kv.page_views([i])[0]:
                view.fill_(i + 1)
        assert ctl.backup(HASHES[:2], [0, 1]).pages == 2
        for i in (4, 5):
            for view in kv.page_views([i])[0]:
                view.zero_()
        gate = Gate(IoOp.GET)
        ctl.store.pm.register(gate)
        handle = ctl.prefetch_async(HASHES[:2], [4, 5])
        assert gate.entered.wait(10)
        release = threading.Timer(0.3, gate.gate.set)  # the held GET finishes at 0.3 s
        release.start()
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.1)
        # staged: abandoned at once; direct: it waited for the batch in flight. Either way the
        # slots are the caller's again: nothing may write them from now on.
        snapshot = [v.clone() for i in (4, 5) for v in kv.page_views([i])[0]]
        release.join()
        loaded = handle.result().pages
        time.sleep(0.3)
        after = [v for i in (4, 5) for v in kv.page_views([i])[0]]
        assert all(bool((a == b).all()) for a, b in zip(snapshot, after)), "slots written after TimeoutError"
        assert loaded in (0, 2)
