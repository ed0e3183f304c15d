"""``max_bytes`` with several processes on one root, small budgets, crash leftovers of the
segment layout's ``O_DIRECT`` probe, durable creation of a new root, and a closed segment store's
directory fds."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from file_helpers import budget_writer, config, files_under, pattern

from hicache_core import IoOp, open_store

PAGE = 16 << 10
BATCH = 16 * PAGE  # what budget_writer writes per batch


def _disk(root: Path) -> int:
    """Bytes under ``root``, the format marker aside (not a page: no budget counts it)."""
    return sum((root / f).stat().st_size for f in files_under(root))


def _writers(root: Path, options: dict[str, Any], n: int, batches: int) -> int:
    """``n`` processes write ``batches`` batches each into ``root`` at once; the bytes under the
    root once all are done, every store still open."""
    ctx = multiprocessing.get_context("forkserver")
    bar, q = ctx.Barrier(n + 1), ctx.Queue()
    procs = [
        ctx.Process(target=budget_writer, args=(str(root), options, w, batches, bar, q)) for w in range(n)
    ]
    for p in procs:
        p.start()
    try:
        bar.wait(timeout=120)
        assert sorted(q.get(timeout=300) for _ in procs) == list(range(n))
        bar.wait(timeout=60)
        used = _disk(root)
        bar.wait(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0] * n
    return used


def test_segments_budget_holds_across_processes(tmp_path: Path) -> None:
    """Four stores, each writing less than the budget: together they must still fit it (within
    the documented overshoot), not hold four budgets."""
    budget, n = 16 << 20, 4
    root = tmp_path / "r"
    used = _writers(root, {"layout": "segments", "max_bytes": budget, "io_threads": 2}, n, 56)  # 14 MiB each
    assert used <= budget + n * (budget // 8 + budget // 16 + BATCH), used
    with open_store(config(root, options={"layout": "segments", "max_bytes": budget})):
        assert _disk(root) <= budget


def test_files_budget_bound_across_processes(tmp_path: Path) -> None:
    """The files layout enforces ``max_bytes`` per store, over the files each knows: N stores at
    once hold at most N budgets (plus a batch each), and the next open brings the root back."""
    budget, n = 4 << 20, 3
    root = tmp_path / "r"
    used = _writers(root, {"max_bytes": budget, "io_threads": 2}, n, 32)  # 8 MiB each
    disk = _disk(root)  # the same files once the writers are gone
    assert budget < used <= n * (budget + BATCH) and disk == used
    with open_store(config(root, options={"max_bytes": budget})):
        assert _disk(root) <= budget


def test_segments_small_budget_is_kept(tmp_path: Path) -> None:
    """A budget smaller than a few default-sized segments: segments shrink with it, so the root
    never holds more than the budget after a batch, and the newest batch survives."""
    budget = 1 << 20
    root = tmp_path / "r"
    with open_store(config(root, options={"layout": "segments", "max_bytes": budget})) as store:
        for b in range(24):  # 6 MiB
            keys = [f"small.p-{b:03d}-{j}" for j in range(8)]
            bufs = [torch.frombuffer(bytearray(pattern(k, PAGE)), dtype=torch.uint8) for k in keys]
            assert all(store.batch_io_v1(IoOp.SET, keys, bufs))
            assert _disk(root) <= budget
            assert all(store.batch_io_v1(IoOp.EXISTS, keys))
        assert store.backend.stats.evictions > 0


def test_probe_files_of_killed_openers_are_removed(tmp_path: Path) -> None:
    """An opener killed during its O_DIRECT probe leaves ``segments/.probe-direct-*``: the next
    open removes it when its writer is gone from this host, or once it is older than
    ``temp_max_age_s``; a live opener's probe (and a fresh one from elsewhere) stays."""
    from hicache_file._publish import HOST

    root = tmp_path / "r"
    with open_store(config(root, options={"layout": "segments"})):
        pass
    seg = root / "segments"
    dead = 4194000  # above the usual pid_max here
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
    gone = seg / f".probe-direct-{HOST}-{dead}-deadbeef-0"
    old = seg / ".probe-direct-deadbeef"  # an earlier build's name: only its age tells
    live = seg / f".probe-direct-{HOST}-{os.getpid()}-cafe0000-0"
    foreign = seg / f".probe-direct-0badc0de-{dead}-cafe0000-0"  # another host: age only
    for p in (gone, old, live, foreign):
        p.write_bytes(bytes(4096))
    hour_ago = time.time() - 7200
    os.utime(old, (hour_ago, hour_ago))
    with open_store(config(root, options={"layout": "segments", "temp_max_age_s": 3600})) as store:
        assert store.backend.stats.temp_files_removed == 2
    assert not gone.exists() and not old.exists()
    assert live.exists() and foreign.exists()


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_fsync_syncs_the_parents_of_a_new_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """With ``fsync``, every directory the store creates, the root and its missing parents
    included, has its parent synced: else a power loss could take the root and its pages away."""
    real = os.fsync
    synced: set[tuple[int, int]] = set()

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "a" / "b"
    with open_store(config(root, options={"fsync": True, "layout": layout})) as store:
        store.batch_io_v1(IoOp.SET, ["fs.p.1"], [torch.ones(PAGE, dtype=torch.uint8)])
    for d in (tmp_path, tmp_path / "a", root):
        st = d.stat()
        assert (st.st_dev, st.st_ino) in synced, d


def _fds_into(d: Path) -> list[int]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(d):
                out.append(int(fd))
        except OSError:
            pass
    return out


def test_closed_segment_store_closes_its_directories(tmp_path: Path) -> None:
    """``close`` closes the fds of ``segments/`` and ``index/`` (not only garbage collection); a
    closed store still answers, opening them again, and collecting it closes those."""
    root = (tmp_path / "r").resolve()
    store = open_store(config(root, options={"layout": "segments"}))
    buf = torch.full((PAGE,), 7, dtype=torch.uint8)
    assert store.batch_io_v1(IoOp.SET, ["cl.p.1"], [buf]) == [True]
    assert _fds_into(root / "segments") and _fds_into(root / "index")
    backend = store.backend
    store.close()
    assert not _fds_into(root / "segments") and not _fds_into(root / "index")
    out = torch.zeros(PAGE, dtype=torch.uint8)
    assert backend.hicache_batch_io_v1(IoOp.GET, ["cl.p.1"], [out]) == [True] and torch.equal(out, buf)
    assert backend.hicache_batch_io_v1(IoOp.SET, ["cl.p.2"], [buf]) == [True]
    backend.hicache_close()
    assert not _fds_into(root / "segments") and not _fds_into(root / "index")
    assert backend.hicache_batch_io_v1(IoOp.EXISTS, ["cl.p.2"], None) == [True]
    del store, backend
    gc.collect()
    assert not _fds_into(root / "segments") and not _fds_into(root / "index")
