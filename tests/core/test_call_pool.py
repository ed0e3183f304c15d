"""Backend calls bounded by ``io_timeout_s`` run on a ``CallPool``: a call that never answers
holds its thread, never the process's exit, and once every thread is held new calls fail at once
instead of queueing (each with its staging copy) without bound."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Generator
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest

import hicache_core as hc
from hicache_core import CacheController, IoOp, MHAKVPool
from hicache_core.transfer import CallPool


class HoldGets:
    def __init__(self) -> None:
        self.gate = threading.Event()

    @hc.hookimpl(wrapper=True)
    def hicache_batch_io_v1(self, op: Any) -> Generator[None, Any, Any]:
        if IoOp(op) is IoOp.GET:
            self.gate.wait(60)
        return (yield)


def test_calls_fail_at_once_when_every_thread_is_held(tmp_path: Path) -> None:
    cfg = hc.StorageConfig(
        backend="file",
        options={"root": str(tmp_path)},
        controller={"io_threads": 1, "io_timeout_s": 0.1},
    )
    hashes = hc.page_hashes(list(range(8)), 4)
    with CacheController(cfg, MHAKVPool(8, 4, 1, 1, 8)) as ctl:
        assert ctl.backup(hashes, [0, 1]).pages == 2
        hold = HoldGets()
        ctl.store.pm.register(hold)
        workers = 4 * 1 + 4
        for _ in range(workers):  # each times out and leaves its thread held
            result = ctl.prefetch(hashes, [2, 3])
            assert result.pages == 0 and "io_timeout_s" in " ".join(result.errors)
        result = ctl.prefetch(hashes, [2, 3])
        assert result.pages == 0 and "looks stuck" in " ".join(result.errors)
        hold.gate.set()  # the backend answers again: the threads come back
        for _ in range(100):
            result = ctl.prefetch(hashes, [2, 3])
            if result.pages == 2:
                break
        assert result.pages == 2


def test_a_hung_call_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import threading, hicache_core as hc
        from hicache_core import IoOp
        class Hang:
            @hc.hookimpl(wrapper=True)
            def hicache_batch_io_v1(self, op):
                if IoOp(op) is IoOp.GET:
                    threading.Event().wait()  # never answers
                return (yield)
        cfg = hc.StorageConfig(backend="file", options={{"root": {str(tmp_path)!r}}},
                               controller={{"io_timeout_s": 0.2}})
        ctl = hc.CacheController(cfg, hc.MHAKVPool(8, 4, 1, 1, 8))
        hashes = hc.page_hashes(list(range(8)), 4)
        assert ctl.backup(hashes, [0, 1]).pages == 2
        ctl.store.pm.register(Hang())
        assert ctl.prefetch(hashes, [2, 3]).pages == 0
        ctl.close(timeout_s=0.2)
        print("left")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "left"


def test_shutdown_cancels_queued_calls_and_refuses_new_ones() -> None:
    pool = CallPool(1)
    gate = threading.Event()
    first = pool.submit(gate.wait)
    for _ in range(500):
        if first.running():
            break
        threading.Event().wait(0.01)
    queued = pool.submit(lambda: 1)
    pool.shutdown()
    with pytest.raises(CancelledError):
        queued.result(timeout=5)
    gate.set()
    assert first.result(timeout=5) is True
    with pytest.raises(hc.ClosedError):
        pool.submit(lambda: 1)
