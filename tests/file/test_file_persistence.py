"""Persistence across reopen and across processes; crash safety under SIGKILL."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from file_helpers import config, crash_writer, fill, pages, pattern, shared_writer, zero

from hicache_core import CacheController, IoOp, MHAKVPool, open_store, page_hashes

# A fresh interpreter reads the pages back and compares them with the same deterministic fill.
_READER = textwrap.dedent(
    """
    import json, sys, torch
    from hicache_core import CacheController, MHAKVPool, StorageConfig, page_hashes
    root, n = sys.argv[1], int(sys.argv[2])
    out = {}
    for layout in ("page_first", "layer_first"):
        want = MHAKVPool(n, 4, 3, 2, 8, layout=layout)
        g = torch.Generator().manual_seed(11)
        for b in want.buffers():
            b.copy_(torch.randint(0, 256, tuple(b.shape), dtype=torch.uint8, generator=g))
        got = MHAKVPool(n, 4, 3, 2, 8, layout=layout)
        cfg = StorageConfig(backend="file", options={"root": root}, layout=layout)
        hashes = page_hashes(list(range(n * 4)), 4)
        with CacheController(cfg, got) as ctl:
            q = ctl.query(hashes).pages
            r = ctl.prefetch(hashes, list(range(n)))
        same = all(torch.equal(a, b) for a, b in zip(want.buffers(), got.buffers()))
        out[layout] = {"query": q, "pages": r.pages, "same": same}
    print(json.dumps(out))
    """
)


def test_reopen_same_process(tmp_path: Path) -> None:
    kv = MHAKVPool(10, 4, 3, 2, 8)
    fill(kv, 1)
    want = pages(kv, range(10))
    hashes = page_hashes(list(range(40)), 4)
    with CacheController(config(tmp_path), kv) as ctl:
        assert ctl.backup(hashes, range(10)).ok
    zero(kv)
    with CacheController(config(tmp_path), kv) as ctl:
        assert ctl.query(hashes).pages == 10
        assert ctl.prefetch(hashes, range(10)).pages == 10
        assert ctl.backup(hashes, range(10)).ok
        assert (ctl.store.backend.stats.writes, ctl.store.backend.stats.skipped_writes) == (0, 20)
    assert pages(kv, range(10)) == want


def test_fresh_process_sees_pages(tmp_path: Path) -> None:
    n = 7
    for layout in ("page_first", "layer_first"):
        kv = MHAKVPool(n, 4, 3, 2, 8, layout=layout)
        fill(kv, 11)
        with CacheController(config(tmp_path, layout=layout), kv) as ctl:
            assert ctl.backup(page_hashes(list(range(n * 4)), 4), range(n)).ok
    out = subprocess.run(
        [sys.executable, "-c", _READER, str(tmp_path), str(n)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    expect = {"query": n, "pages": n, "same": True}
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"page_first": expect, "layer_first": expect}


@pytest.fixture(scope="module")
def forkserver() -> Any:
    """Fresh processes forked from a server that has torch and the plugin imported already."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hicache_core", "hicache_file", "file_helpers"])
    return ctx


@pytest.mark.parametrize("publish", ["tmpfile", "rename"])
def test_sigkill_never_leaves_a_readable_torn_page(tmp_path: Path, forkserver: Any, publish: str) -> None:
    nbytes = 1 << 20
    start = 0
    for loop in range(5):
        ready = forkserver.Event()
        child = forkserver.Process(target=crash_writer, args=(str(tmp_path), nbytes, start, ready, publish))
        child.start()
        assert ready.wait(60), "writer did not start"
        time.sleep(0.05 + 0.06 * loop)
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        start += 4000
    with open_store(config(tmp_path)) as store:
        keys = [f"crash.p.{j:06d}" for j in range(start)]
        present = store.batch_io_v1(IoOp.EXISTS, keys)
        live = [k for k, p in zip(keys, present) if p]
        assert live, "the writer never published a page; the test proves nothing"
        bufs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in live]
        got = store.batch_io_v1(IoOp.GET, live, bufs)
        assert all(got), "a published page failed verification after SIGKILL"
        for key, buf in zip(live, bufs):
            assert buf.numpy().tobytes() == pattern(key, nbytes), key
        assert store.backend.stats.integrity_errors == 0


def test_two_processes_write_the_same_pages(tmp_path: Path, forkserver: Any) -> None:
    procs = [forkserver.Process(target=shared_writer, args=(str(tmp_path), 3)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with open_store(config(tmp_path)) as store:
        keys = [f"shared.p.{j:04d}" for j in range(200)]
        bufs = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
        assert all(store.batch_io_v1(IoOp.GET, keys, bufs))
        assert all(int(b[0]) == j % 251 and bool((b == b[0]).all()) for j, b in enumerate(bufs))
