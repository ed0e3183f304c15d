"""Persistence across reopen and across processes; crash safety under SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch
from file_helpers import config, fill, pages, zero

from hicache_core import CacheController, IoOp, MHAKVPool, open_store, page_hashes

# A child that reads the pages back and compares them with the same deterministic fill.
_READER = textwrap.dedent(
    """
    import json, sys, torch
    from hicache_core import CacheController, MHAKVPool, StorageConfig, page_hashes
    root, layout, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
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
    print(json.dumps({"query": q, "pages": r.pages, "same": same}))
    """
)


def test_reopen_same_process(tmp_path) -> None:
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
        assert ctl.backup(hashes, range(10)).skipped == 10
    assert pages(kv, range(10)) == want


def test_fresh_process_sees_pages(tmp_path) -> None:
    for layout in ("page_first", "layer_first"):
        n = 7
        kv = MHAKVPool(n, 4, 3, 2, 8, layout=layout)
        fill(kv, 11)
        with CacheController(config(tmp_path, layout=layout), kv) as ctl:
            assert ctl.backup(page_hashes(list(range(n * 4)), 4), range(n)).ok
        out = subprocess.run(
            [sys.executable, "-c", _READER, str(tmp_path), layout, str(n)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {"query": n, "pages": n, "same": True}


# A child writing large pages forever (v1, deterministic bytes per key) until it is killed.
_WRITER = textwrap.dedent(
    """
    import hashlib, sys, torch
    from hicache_core import IoOp, StorageConfig, open_store
    root, nbytes, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = open_store(StorageConfig(backend="file", options={"root": root, "io_threads": 2,
                                                              "parallel_min_bytes": 0}))
    def pattern(key):
        seed = hashlib.sha256(key.encode()).digest()
        return torch.frombuffer(bytearray((seed * (nbytes // 32 + 1))[:nbytes]), dtype=torch.uint8)
    i = start
    print("ready", flush=True)
    while True:
        keys = [f"crash.p.{j:06d}" for j in range(i, i + 4)]
        store.batch_io_v1(IoOp.SET, keys, [pattern(k) for k in keys])
        i += 4
    """
)


def test_sigkill_never_leaves_a_readable_torn_page(tmp_path) -> None:
    import hashlib

    nbytes = 1 << 20
    start = 0
    for loop in range(5):
        child = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(nbytes), str(start)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.15 + 0.07 * loop)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
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
            seed = hashlib.sha256(key.encode()).digest()
            assert buf.numpy().tobytes() == (seed * (nbytes // 32 + 1))[:nbytes], key
        assert store.backend.stats.integrity_errors == 0


_CONCURRENT = textwrap.dedent(
    """
    import sys, torch
    from hicache_core import IoOp, StorageConfig, open_store
    root = sys.argv[1]
    store = open_store(StorageConfig(backend="file", options={"root": root}))
    keys = [f"shared.p.{j:04d}" for j in range(200)]
    bufs = [torch.full((4096,), j % 251, dtype=torch.uint8) for j in range(200)]
    for _ in range(3):
        assert all(store.batch_io_v1(IoOp.SET, keys, bufs))
    print("ok")
    """
)


def test_two_processes_write_the_same_pages(tmp_path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONCURRENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok"
    with open_store(config(tmp_path)) as store:
        keys = [f"shared.p.{j:04d}" for j in range(200)]
        bufs = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
        assert all(store.batch_io_v1(IoOp.GET, keys, bufs))
        assert all(int(b[0]) == j % 251 and bool((b == b[0]).all()) for j, b in enumerate(bufs))
