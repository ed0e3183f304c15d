"""The segment layout of the file backend (``layout: "segments"``): round trips, recovery,
damage (bit flips in data and index, a torn index tail), eviction, clear, tmpfs and O_DIRECT."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from file_helpers import config, fill, pages, zero
from hicache_file import FileRootError

from hicache_core import CacheController, IoOp, MHAKVPool, MLAKVPool, PoolName, page_hashes

REC_MAGIC = b"\xd5\x8e\xa7\xf1"  # hicache_file._seglog: where an index record starts


def _cfg(root: Path, cfg: dict[str, object] | None = None, **opts: object) -> object:
    return config(root, options={"layout": "segments", **opts}, model_name="seg", **(cfg or {}))


def _pool(n: int = 8, layout: str = "page_first", tokens: int = 16) -> MHAKVPool:
    pool = MHAKVPool(n, tokens, 4, 2, 64, torch.bfloat16, layout=layout)
    fill(pool, 7)
    return pool


def _hashes(n: int, start: int = 0) -> list[str]:
    return page_hashes(list(range(start, start + 4 * n)), 4)


def _logs(root: Path) -> list[Path]:
    return sorted((root / "index").glob("*.log"))


def _segs(root: Path) -> list[Path]:
    return sorted((root / "segments").glob("*.seg"))


def _roundtrip(root: Path, pool: MHAKVPool, hashes: list[str], **opts: object) -> tuple[int, int]:
    want = pages(pool, range(len(hashes)))
    cfg = {"layout": pool.layout.value}
    with CacheController(_cfg(root, cfg, **opts), pool) as ctl:
        stored = ctl.backup(hashes, range(len(hashes))).pages
    zero(pool)
    with CacheController(_cfg(root, cfg, **opts), pool) as ctl:  # a fresh store: recovery from the logs
        got = ctl.prefetch(hashes, range(len(hashes))).pages
    assert pages(pool, range(got)) == want[: 2 * got]
    return stored, got


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("direct_io", [True, False, "auto"])
def test_roundtrip_and_reopen(tmp_path: Path, layout: str, direct_io: bool | str) -> None:
    pool = _pool(8, layout)
    assert _roundtrip(tmp_path / "r", pool, _hashes(8), direct_io=direct_io) == (8, 8)
    assert len(_logs(tmp_path / "r")) == 1 and len(_segs(tmp_path / "r")) == 1


def test_unaligned_components_are_padded(tmp_path: Path) -> None:
    """Components whose size is not a multiple of 4096 (here 3 tokens x 512 B) still round-trip."""
    pool = _pool(6, tokens=3)
    assert pool.component_nbytes[0] % 4096
    assert _roundtrip(tmp_path / "r", pool, _hashes(6)) == (6, 6)


def test_mla_and_every_component_of_a_page_in_one_record(tmp_path: Path) -> None:
    mla = MLAKVPool(4, 16, 4, 64, torch.bfloat16)
    fill(mla, 3)
    want = pages(mla, range(4))
    with CacheController(_cfg(tmp_path / "r", {"is_mla_model": True}), mla) as ctl:
        assert ctl.backup(_hashes(4), range(4)).pages == 4
        zero(mla)
        assert ctl.prefetch(_hashes(4), range(4)).pages == 4
    assert pages(mla, range(4)) == want
    mha = _pool(4)
    with CacheController(_cfg(tmp_path / "r2"), mha) as ctl:
        ctl.backup(_hashes(4), range(4))
    assert _logs(tmp_path / "r2")[0].read_bytes().count(REC_MAGIC) == 4  # K and V of a page: one record


def test_data_bit_flip_is_a_counted_miss_and_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = _pool(8)
    hashes = _hashes(8)
    root = tmp_path / "r"
    want = pages(pool, range(8))
    with CacheController(_cfg(root), pool) as ctl:
        ctl.backup(hashes, range(8))
    seg = _segs(root)[0]
    comp = pool.component_nbytes[0]
    with open(seg, "r+b") as f:  # one bit in the V component of page 3 (pages are K, V, K, V, ...)
        off = (2 * 3 + 1) * comp + 100
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b ^ 0x10]))
    zero(pool)
    caplog.set_level(logging.WARNING, logger="hicache.file")
    with CacheController(_cfg(root), pool) as ctl:
        res = ctl.store.batch_io_v1(
            IoOp.GET,
            [k for ks in ctl.store.page_keys(PoolName.KV, hashes) for k in ks],
            [v for vs in pool.page_views(range(8)) for v in vs],
        )
        assert res == [True] * 7 + [False] + [True] * 8
        backend = ctl.store.backend
        assert backend.stats.integrity_errors == 1
        assert any("checksum mismatch" in r.getMessage() for r in caplog.records)
        assert pages(pool, range(3)) == want[:6]
        fill(pool, 7)
        assert ctl.query(hashes).pages == 3  # the damaged page is forgotten: backup writes it again
        assert ctl.backup(hashes, range(8)).pages == 8
        zero(pool)
        assert ctl.prefetch(hashes, range(8)).pages == 8
    assert pages(pool, range(8)) == want


def test_index_bit_flip_costs_one_page(tmp_path: Path) -> None:
    pool = _pool(8)
    hashes = _hashes(8)
    root = tmp_path / "r"
    with CacheController(_cfg(root), pool) as ctl:
        ctl.backup(hashes, range(8))
    log_path = _logs(root)[0]
    data = bytearray(log_path.read_bytes())
    starts = [i for i in range(len(data)) if data.startswith(REC_MAGIC, i)]
    assert len(starts) == 8
    data[starts[4] + 40] ^= 0x01  # inside page 4's record (an entry field)
    log_path.write_bytes(bytes(data))
    want = pages(pool, range(8))
    zero(pool)
    with CacheController(_cfg(root), pool) as ctl:
        keys = ctl.store.page_keys(PoolName.KV, hashes)
        found = ctl.store.batch_io_v1(IoOp.EXISTS, [k for ks in keys for k in ks])
        assert found == [True] * 8 + [False, False] + [True] * 6
        assert ctl.prefetch(hashes[:4], range(4)).pages == 4
    assert pages(pool, range(4)) == want[:8]


def test_torn_index_tail_loses_only_that_record(tmp_path: Path) -> None:
    pool = _pool(8)
    hashes = _hashes(8)
    root = tmp_path / "r"
    with CacheController(_cfg(root), pool) as ctl:
        ctl.backup(hashes, range(8))
    log_path = _logs(root)[0]
    data = log_path.read_bytes()
    last = data.rfind(REC_MAGIC)
    os.truncate(log_path, last + (len(data) - last) // 2)  # the last record half written
    want = pages(pool, range(8))
    zero(pool)
    with CacheController(_cfg(root), pool) as ctl:
        assert ctl.query(hashes).pages == 7
        assert ctl.prefetch(hashes, range(8)).pages == 7
        assert pages(pool, range(7)) == want[:14]
        fill(pool, 7)
        assert ctl.backup(hashes, range(8)).pages == 8  # the lost page is written again
    zero(pool)
    with CacheController(_cfg(root), pool) as ctl:
        assert ctl.prefetch(hashes, range(8)).pages == 8
    assert pages(pool, range(8)) == want


def test_writers_share_one_root(tmp_path: Path) -> None:
    """Two stores on one root are two writers (own segment and log each); each sees the other's
    pages, and a clear in one is seen by the other."""
    root = tmp_path / "r"
    a_pool, b_pool = _pool(4), _pool(4)
    fill(b_pool, 9)
    with CacheController(_cfg(root), a_pool) as a, CacheController(_cfg(root), b_pool) as b:
        assert a.backup(_hashes(4), range(4)).pages == 4
        assert b.backup(_hashes(4, 100), range(4)).pages == 4
        assert len(_logs(root)) == 2 and len(_segs(root)) == 2
        assert a.query(_hashes(4, 100)).pages == 4 and b.query(_hashes(4)).pages == 4
        want = pages(b_pool, range(4))
        zero(a_pool)
        assert a.prefetch(_hashes(4, 100), range(4)).pages == 4
        assert pages(a_pool, range(4)) == want
        ns = a.store.page_keys(PoolName.KV, _hashes(1))[0][0].partition(".")[0]
        assert a.store.backend.hicache_clear(namespace=ns) == 16
        assert b.query(_hashes(4)).pages == 0 and b.query(_hashes(4, 100)).pages == 0
        # a's segment lost every page: sealed and removed; b still appends to its own
        assert [p.name for p in _segs(root)] == [f"{b.store.backend.segments.writer}-000000.seg"]
        # a store that reads the clear before the older pages it removed (b's log moved aside,
        # then back) must not revive them
        b_log = root / "index" / f"{b.store.backend.segments.writer}.log"
        os.rename(b_log, tmp_path / "aside.log")
        with CacheController(_cfg(root), _pool(4)) as c:
            assert c.query(_hashes(4)).pages == 0
            os.rename(tmp_path / "aside.log", b_log)
            assert c.query(_hashes(4, 100)).pages == 0
            fill(b_pool, 9)
            assert b.backup(_hashes(4), range(4)).pages == 4
            assert a.query(_hashes(4)).pages == 4  # stored after the clear: visible
            assert c.query(_hashes(4)).pages == 4


def test_eviction_by_whole_segment(tmp_path: Path) -> None:
    root = tmp_path / "r"
    pool = _pool(16, tokens=64)  # 64 KiB components, 128 KiB pages
    budget = 12 << 20
    with CacheController(_cfg(root, max_bytes=budget), pool) as ctl:
        backend = ctl.store.backend
        for r in range(20):  # 40 MiB written in all, segments of 4 MiB
            fill(pool, r)
            assert ctl.backup(_hashes(16, 1000 * r), range(16)).pages == 16
            total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
            assert total <= budget + (4 << 20)  # the budget plus at most the segment being written
        assert backend.stats.evictions > 0 and backend.stats.evicted_bytes > 0
        last = _hashes(16, 1000 * 19)
        want = pages(pool, range(16))
        zero(pool)
        assert ctl.prefetch(last, range(16)).pages == 16
        assert pages(pool, range(16)) == want
        assert ctl.query(_hashes(16, 0)).pages == 0  # the oldest pages were dropped with their segment
    with CacheController(_cfg(root, max_bytes=budget), pool) as ctl:  # and they stay gone
        assert ctl.query(_hashes(16, 0)).pages == 0
        assert ctl.query(last).pages == 16


def test_layout_is_fixed_per_root(tmp_path: Path) -> None:
    pool = _pool(2)
    with CacheController(config(tmp_path / "f"), pool) as ctl:
        ctl.backup(_hashes(2), range(2))
    with pytest.raises(FileRootError, match=r"set options\.layout to 'files'"):
        CacheController(_cfg(tmp_path / "f"), pool)
    CacheController(_cfg(tmp_path / "s"), pool).close()
    with pytest.raises(FileRootError, match=r"set options\.layout to 'segments'"):
        CacheController(config(tmp_path / "s"), pool)


def test_symlinks_below_the_root_are_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "r"
    pool = _pool(2)
    with CacheController(_cfg(root), pool) as ctl:
        ctl.backup(_hashes(2), range(2))
    seg = _segs(root)[0]
    (outside / "victim").write_bytes(seg.read_bytes())
    seg.unlink()
    seg.symlink_to(outside / "victim")  # same bytes, but through a symlink: never read
    with CacheController(_cfg(root), pool) as ctl:
        assert ctl.prefetch(_hashes(2), range(2)).pages == 0
    os.rename(root / "index", tmp_path / "idx")
    (root / "index").symlink_to(tmp_path / "idx")
    with pytest.raises(FileRootError, match="symlink"):
        CacheController(_cfg(root), pool)
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_no_o_direct_falls_back_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache_file import _segments

    monkeypatch.setattr(
        _segments, "probe_direct", lambda dfd: "open(O_DIRECT) fails: [Errno 22] Invalid argument"
    )
    caplog.set_level(logging.INFO, logger="hicache.file")
    pool = _pool(4)
    assert _roundtrip(tmp_path / "r", pool, _hashes(4)) == (4, 4)
    lines = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(lines) == 2 and all(
        "buffered I/O" in m and "Invalid argument" in m for m in lines
    )  # one per open


def test_tmpfs(caplog: pytest.LogCaptureFixture) -> None:
    """On /dev/shm: works; when its kernel has no O_DIRECT for tmpfs (before Linux 6.6), the
    fallback is named in the log."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile

    caplog.set_level(logging.INFO, logger="hicache.file")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        pool = _pool(4)
        root = Path(d) / "r"
        assert _roundtrip(root, pool, _hashes(4)) == (4, 4)
        with CacheController(_cfg(root), pool) as ctl:
            direct = ctl.store.backend.segments.direct
    named = [r.getMessage() for r in caplog.records if "no O_DIRECT" in r.getMessage()]
    assert bool(named) == (not direct)


def test_injected_enospc(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segment writes fail with ENOSPC after a budget: failed pages are False, stored ones read."""
    import errno

    real = os.pwritev
    budget = {"left": 6 * 32 * 1024}  # 6 pages of 2 x 16 KiB

    def pwritev(fd: int, bufs: list, offset: int) -> int:
        total = sum(memoryview(b).nbytes for b in bufs)
        if total > budget["left"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget["left"] -= total
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    caplog.set_level(logging.WARNING, logger="hicache.file")
    pool = _pool(4)
    root = tmp_path / "r"
    stored: list[str] = []
    with CacheController(_cfg(root), pool) as ctl:
        for r in range(3):
            hs = _hashes(4, 100 * r)
            ok = ctl.backup(hs, range(4)).per_pool[PoolName.KV]
            stored += [h for h, f in zip(hs, ok) if f]
        assert ctl.store.backend.stats.write_errors > 0
    assert 0 < len(stored) < 12
    assert any("No space left" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(os, "pwritev", real)
    with CacheController(_cfg(root), pool) as ctl:
        for h in stored:
            assert ctl.query([h]).pages == 1


@pytest.mark.parametrize("io_threads", [1, 2])
def test_fsync_makes_data_records_and_new_entries_durable_before_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_threads: int
) -> None:
    """With ``fsync`` a batch is reported only after its data, its records and the directory
    entries of a segment or log it created are all synced (the syncs may run in parallel)."""
    calls: list[str] = []
    real_sync, real_fsync, real_write, real_pwritev = os.fdatasync, os.fsync, os.write, os.pwritev
    lock = __import__("threading").Lock()

    def name(fd: int) -> str:
        path = os.readlink(f"/proc/self/fd/{fd}")
        return "log" if path.endswith(".log") else "seg" if path.endswith(".seg") else os.path.basename(path)

    def note(what: str) -> None:
        with lock:
            calls.append(what)

    def fdatasync(fd: int) -> None:
        real_sync(fd)
        note(f"{name(fd)}-sync")

    def fsync(fd: int) -> None:
        real_fsync(fd)
        note(f"{name(fd)}-sync")

    def write(fd: int, data: bytes) -> int:
        if name(fd) == "log":
            note("log-write")
        return real_write(fd, data)

    def pwritev(fd: int, bufs: list, offset: int) -> int:
        note("seg-write")
        return real_pwritev(fd, bufs, offset)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwritev", pwritev)
    pool = _pool(4)
    with CacheController(_cfg(tmp_path / "r", fsync=True, io_threads=io_threads), pool) as ctl:
        calls.clear()
        assert ctl.backup(_hashes(4, 100), range(4)).pages == 4  # creates the segment and the log
        first = list(calls)
        calls.clear()
        assert ctl.backup(_hashes(4), range(4)).pages == 4
        second = list(calls)
    # the records follow the data; the backup returns after every sync (none is left running)
    for seen, new_entries in ((first, {"segments-sync", "index-sync"}), (second, set())):
        writes = [i for i, c in enumerate(seen) if c == "seg-write"]
        last_log_write = max(i for i, c in enumerate(seen) if c == "log-write")
        assert writes and seen.index("log-write") > max(writes)
        assert sorted(seen[last_log_write + 1 :]) == sorted(["seg-sync", "log-sync", *new_entries]), seen


def test_eviction_removes_a_gone_writers_segments_and_log(tmp_path: Path) -> None:
    """A writer process that exited leaves its segment and log; once eviction has taken its
    segments, its log goes too."""
    import subprocess
    import sys

    root = tmp_path / "r"
    budget = 8 << 20
    child = (
        "import torch, sys\n"
        "from hicache_core import CacheController, MHAKVPool, StorageConfig, page_hashes\n"
        "pool = MHAKVPool(16, 64, 4, 2, 64, torch.bfloat16)\n"
        f"cfg = StorageConfig(backend='file', options={{'root': {str(root)!r}, 'layout': 'segments', "
        f"'max_bytes': {budget}}}, model_name='seg')\n"
        "with CacheController(cfg, pool) as ctl:\n"
        "    assert ctl.backup(page_hashes(list(range(64)), 4), range(16)).pages == 16\n"
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    assert len(_logs(root)) == 1
    gone_log = _logs(root)[0]
    pool = _pool(16, tokens=64)
    with CacheController(_cfg(root, max_bytes=budget), pool) as ctl:
        assert ctl.query(page_hashes(list(range(64)), 4)).pages == 16  # the child's pages are shared
        for r in range(1, 8):
            fill(pool, r)
            assert ctl.backup(_hashes(16, 1000 * r), range(16)).pages == 16
        assert ctl.query(page_hashes(list(range(64)), 4)).pages == 0
    assert not gone_log.exists()
    assert len(_logs(root)) == 1


def test_a_killed_writers_preallocated_tail_is_cut_at_the_next_open(tmp_path: Path) -> None:
    """A writer killed with its segment open leaves the preallocated tail; the next store opened
    on the root cuts it back to the last recorded page (and unlinks a segment no record names),
    keeping every recorded page; a live writer's segment is never touched."""
    import signal
    import subprocess
    import sys

    root = tmp_path / "r"
    child = (
        "import os, signal, torch\n"
        "from hicache_core import CacheController, MHAKVPool, StorageConfig, page_hashes\n"
        "pool = MHAKVPool(8, 16, 4, 2, 64, torch.bfloat16)\n"
        f"cfg = StorageConfig(backend='file', options={{'root': {str(root)!r}, 'layout': 'segments'}}, "
        "model_name='seg')\n"
        "ctl = CacheController(cfg, pool)\n"
        "assert ctl.backup(page_hashes(list(range(32)), 4), range(8)).pages == 8\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", child], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    (seg,) = _segs(root)
    written = 8 * 2 * 16 * 4 * 2 * 64 * 2  # 8 pages of 2 components, bf16
    assert seg.stat().st_size > written  # the preallocated tail
    orphan = seg.with_name(seg.name.replace("-000000.seg", "-000001.seg"))
    orphan.write_bytes(b"x" * 8192)  # a segment its writer started but recorded nothing in
    live_pool = _pool(2)
    with CacheController(_cfg(root), live_pool) as live:  # a live writer: its tail stays
        assert live.backup(_hashes(2, 500), range(2)).pages == 2
        (live_seg,) = [s for s in _segs(root) if s != seg and s != orphan]
        live_size = live_seg.stat().st_size
        pool = _pool(8)
        with CacheController(_cfg(root), pool) as ctl:
            assert seg.stat().st_size == written
            assert not orphan.exists()
            assert live_seg.stat().st_size == live_size
            assert ctl.prefetch(page_hashes(list(range(32)), 4), range(8)).pages == 8


def test_index_log_rotation_keeps_every_page_and_frees_old_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log past ``LOG_MAX`` is rotated (new writer id, log and segments); under ``max_bytes``
    a rotated log goes with the last of its segments; every page stays readable, also from a
    fresh store, and a log holding a CLEAR is kept (its record still hides older pages)."""
    import hicache_file._segments as segments

    monkeypatch.setattr(segments, "LOG_MAX", 2048)  # about two batches of four pages
    root = tmp_path / "r"
    pool = _pool(4)
    batches = [_hashes(4, 100 * b) for b in range(40)]
    writers: set[str] = set()
    reader = CacheController(_cfg(root), _pool(4))  # another writer, tailing the rotated logs
    with reader, CacheController(_cfg(root, max_bytes=512 << 10), pool) as ctl:
        for b, hs in enumerate(batches):
            if b == 2:
                ctl.clear()
                clear_log = root / "index" / f"{ctl.store.backend.segments.writer}.log"  # holds the CLEAR
            fill(pool, b)
            assert ctl.backup(hs, range(4)).pages == 4
            zero(pool)
            assert ctl.prefetch(hs, range(4)).pages == 4
            fill(pool, b)
            want = pages(pool, range(4))
            zero(pool)
            ctl.prefetch(hs, range(4))
            assert pages(pool, range(4)) == want
            writers |= {p.stem for p in _logs(root)}
            assert reader.query(hs).pages == 4
        assert ctl.query(batches[-1]).pages == 4
        logs = _logs(root)
        tailed = reader.store.backend.segments._logs  # logs it reads (an open fd each)
        assert set(tailed) <= {p.name for p in logs}  # removed logs are closed and forgotten
    assert len(writers) >= 10  # it rotated
    assert 2 <= len(logs) <= 6  # the CLEAR's log, the current one, those of unevicted segments
    assert clear_log in logs
    fill(pool, len(batches) - 1)
    want = pages(pool, range(4))
    zero(pool)
    with CacheController(_cfg(root, max_bytes=512 << 10), pool) as ctl:
        assert ctl.prefetch(batches[-1], range(4)).pages == 4
        assert ctl.query(batches[0]).pages == 0
    assert pages(pool, range(4)) == want


def test_a_clear_by_a_writer_that_exited_stays_after_its_log_is_reclaimed(tmp_path: Path) -> None:
    """A clear is kept for good: once the clearing writer's process has exited and another
    store reclaims the logs of gone writers, a freshly opened store still misses the pages the
    clear removed (they stay in a live writer's segment), never sees them again."""
    import subprocess
    import sys

    root = tmp_path / "r"
    pool = _pool(4)
    fill(pool, 3)
    with CacheController(_cfg(root), pool) as a:
        assert a.backup(_hashes(4), range(4)).pages == 4
        ns = a.store.page_keys(PoolName.KV, _hashes(1))[0][0].partition(".")[0]
        child = (
            "from hicache_core import StorageConfig, open_store\n"
            f"cfg = StorageConfig(backend='file', options={{'root': {str(root)!r}, 'layout': 'segments'}}, "
            "model_name='seg')\n"
            "with open_store(cfg) as store:\n"
            f"    store.backend.hicache_clear(namespace={ns!r})\n"
        )
        subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
        assert a.query(_hashes(4)).pages == 0
        with CacheController(_cfg(root), _pool(4)) as c:
            assert c.query(_hashes(4)).pages == 0
            c.store.backend.segments._drop_dead_logs()  # what eviction runs under max_bytes
        with CacheController(_cfg(root), _pool(4)) as d:
            assert d.query(_hashes(4)).pages == 0


def test_a_page_split_over_runs_is_stored_only_if_every_run_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs hold whole components, so a page's K and V may go in different ``pwritev`` calls:
    the page whose V failed is not stored (no record), its neighbours are."""
    import errno

    import hicache_file._segments as segments

    monkeypatch.setattr(segments, "CHUNK", 16 * 1024)  # one 16 KiB component per run
    real, calls = os.pwritev, {"n": 0}

    def pwritev(fd: int, bufs: list, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 4:  # page 1's V (runs go in order with one I/O thread)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    pool, root, hs = _pool(4), tmp_path / "r", _hashes(4)
    want = pages(pool, range(4))
    with CacheController(_cfg(root, direct_io=False, io_threads=1), pool) as ctl:
        assert ctl.backup(hs, range(4)).per_pool[PoolName.KV] == [True, False, True, True]
        stats = ctl.store.backend.stats
        assert (stats.writes, stats.write_errors) == (6, 2)  # page 1's K is not recorded alone
    assert calls["n"] == 8
    monkeypatch.setattr(os, "pwritev", real)
    zero(pool)
    with CacheController(_cfg(root, direct_io=False), pool) as ctl:
        assert [ctl.query([h]).pages for h in hs] == [1, 0, 1, 1]
        assert ctl.prefetch(hs[:1], [0]).pages == 1
        assert ctl.prefetch(hs[2:], [2, 3]).pages == 2
    got = pages(pool, range(4))
    assert got[0:2] == want[0:2] and got[4:8] == want[4:8]
