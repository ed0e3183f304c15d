"""Bad roots, bad options, ENOSPC and short writes: typed errors and per-key failures."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch
from file_helpers import config, fill, pages, temp_files, zero
from hicache_file import FileBackend, FileOptions, FileRootError, default_root

from hicache_core import (
    BackendIOError,
    CacheController,
    HiCacheError,
    IoOp,
    MHAKVPool,
    OptionsError,
    PoolName,
    open_store,
    page_hashes,
)


def test_root_is_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    with pytest.raises(FileRootError) as info:
        open_store(config(path))
    msg = str(info.value)
    assert str(path) in msg and "options.root" in msg
    assert isinstance(info.value, BackendIOError) and isinstance(info.value, OSError)


def test_root_below_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(FileRootError, match="cannot be created"):
        open_store(config(path / "sub" / "root"))


def test_root_on_a_filesystem_nobody_can_write() -> None:
    # /proc refuses new directories even for root, so this works as root too.
    with pytest.raises(FileRootError, match="/proc/hicache-file-test"):
        open_store(config("/proc/hicache-file-test"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_root_without_write_permission(tmp_path: Path) -> None:  # pragma: no cover - non-root only
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(FileRootError, match="not writable"):
            open_store(config(ro))
    finally:
        ro.chmod(0o700)


def test_root_with_a_foreign_format(tmp_path: Path) -> None:
    (tmp_path / ".hicache-file.json").write_text('{"format": 99}')
    with pytest.raises(FileRootError, match="format 99"):
        open_store(config(tmp_path))


def test_root_of_format_1_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A root written by hicache-file 0.1 (unpadded headers) is never read with the wrong offsets."""
    (tmp_path / ".hicache-file.json").write_text('{"format": 1, "layout": "<namespace>/<key[-3:]>/<key>"}')
    with pytest.raises(FileRootError, match=r"format 1 .*hicache-file 0\.1.*another directory, or delete"):
        open_store(config(tmp_path))


def test_root_with_another_layout_is_refused(tmp_path: Path) -> None:
    """Format 2 written by the first builds (4096 shards) is never searched in the wrong places."""
    (tmp_path / ".hicache-file.json").write_text('{"format": 2, "layout": "<namespace>/<key[-3:]>/<key>"}')
    with pytest.raises(FileRootError, match=r"layout .*key\[-3:\].*another directory, or delete"):
        open_store(config(tmp_path))


def test_options(tmp_path: Path) -> None:
    with pytest.raises(OptionsError, match="max_byte"):
        open_store(config(tmp_path, options={"max_byte": 10}))
    with pytest.raises(OptionsError, match="io_threads"):
        open_store(config(tmp_path, options={"io_threads": 0}))
    assert FileOptions(max_bytes="64MiB").max_bytes == 64 << 20
    assert FileOptions(max_bytes="1.5G").max_bytes == 3 << 29
    assert FileOptions(max_bytes=123).max_bytes == 123
    with pytest.raises(ValueError):
        FileOptions(max_bytes="lots")
    assert FileOptions(root="~/x").root == os.path.expanduser("~/x")
    assert FileOptions().resolved_root() == default_root()
    assert default_root().endswith(os.path.join("hicache", "file"))
    assert FileBackend.Options is FileOptions


def _fail_writev_after(monkeypatch: pytest.MonkeyPatch, ok_calls: int, err: int = errno.ENOSPC) -> list[int]:
    calls = [0]
    real = os.writev

    def writev(fd: int, bufs) -> int:  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > ok_calls:
            raise OSError(err, os.strerror(err))
        return real(fd, bufs)

    monkeypatch.setattr(os, "writev", writev)
    return calls


@pytest.mark.parametrize("publish", ["tmpfile", "rename"])
def test_enospc_fails_only_the_affected_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, publish: str
) -> None:
    kv = MHAKVPool(8, 4, 2, 2, 8)
    fill(kv, 1)
    want = pages(kv, range(3))
    hashes = page_hashes(list(range(32)), 4)
    cfg = config(tmp_path, options={"io_threads": 1, "publish": publish})
    with CacheController(cfg, kv) as ctl:
        _fail_writev_after(monkeypatch, ok_calls=6)  # 3 pages x (k, v), then the disk is full
        with caplog.at_level(logging.WARNING, logger="hicache.file"):
            res = ctl.backup(hashes, range(8))
        monkeypatch.undo()
        assert res.per_pool[PoolName.KV] == [True] * 3 + [False] * 5
        assert res.pages == 3
        warnings = [r for r in caplog.records if r.name == "hicache.file"]
        assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
        assert "10 of 16 set" in warnings[0].getMessage()
        assert not temp_files(tmp_path), "a failed write must not leave a temp file"
        assert ctl.store.backend.stats.write_errors == 10
        zero(kv)
        assert ctl.prefetch(hashes, range(8)).pages == 3
        assert pages(kv, range(3)) == want
        fill(kv, 1)
        assert ctl.backup(hashes, range(8)).ok  # space is back: the rest is written


@pytest.mark.parametrize("publish", ["tmpfile", "rename"])
def test_short_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, publish: str) -> None:
    real = os.writev

    def short_writev(fd: int, bufs) -> int:  # type: ignore[no-untyped-def]
        first = bytes(memoryview(bufs[0]).cast("B"))[:7]  # write only part of the header
        return real(fd, [first])

    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    with open_store(config(tmp_path, options={"publish": publish})) as store:
        monkeypatch.setattr(os, "writev", short_writev)
        assert store.batch_io_v1(IoOp.SET, ["s.k"], [data]) == [True]
        monkeypatch.undo()
        out = torch.zeros(5000, dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.GET, ["s.k"], [out]) == [True]
        assert torch.equal(out, data)


@pytest.mark.parametrize("publish", ["tmpfile", "rename"])
def test_publish_failure_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, publish: str
) -> None:
    def fail(*args: object, **kw: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    with open_store(config(tmp_path, options={"publish": publish})) as store:
        assert store.backend.publish_mode == publish
        monkeypatch.setattr(os, "rename", fail)
        monkeypatch.setattr(os, "link", fail)
        bufs = [torch.ones(100, dtype=torch.uint8)] * 3
        assert store.batch_io_v1(IoOp.SET, ["r.a", "r.b", "r.c"], bufs) == [False] * 3
        monkeypatch.undo()
        assert not temp_files(tmp_path)
        assert store.batch_io_v1(IoOp.EXISTS, ["r.a", "r.b", "r.c"]) == [False] * 3


def test_unreadable_page_is_a_miss_not_an_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def failing_open(path, flags, *a, **kw):  # type: ignore[no-untyped-def]
        # pages are opened by name relative to their shard directory's fd
        if os.path.basename(path) == "e.bad" and not flags & os.O_CREAT:
            raise OSError(errno.EIO, "I/O error", path)
        return real_open(path, flags, *a, **kw)

    with open_store(config(tmp_path)) as store:
        bufs = [torch.ones(64, dtype=torch.uint8)] * 2
        assert store.batch_io_v1(IoOp.SET, ["e.bad", "e.good"], bufs) == [True, True]
        monkeypatch.setattr(os, "open", failing_open)
        outs = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
        assert store.batch_io_v1(IoOp.GET, ["e.bad", "e.good"], outs) == [False, True]
        monkeypatch.undo()
        assert store.backend.stats.read_errors == 1


def test_publish_modes(tmp_path: Path) -> None:
    with open_store(config(tmp_path)) as store:
        assert store.backend.publish_mode == "tmpfile"  # Linux + ext4/tmpfs: auto picks it
    with open_store(config(tmp_path, options={"publish": "rename"})) as store:
        assert store.backend.publish_mode == "rename"
    with pytest.raises(OptionsError, match="publish"):
        open_store(config(tmp_path, options={"publish": "copy"}))


def test_errors_are_hicache_errors(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("")
    with pytest.raises(HiCacheError):
        open_store(config(path))


def test_close_stops_threads_and_is_idempotent(tmp_path: Path) -> None:
    opts = {"io_threads": 3, "parallel_min_bytes": 0}
    store = open_store(config(tmp_path, options=opts))
    bufs = [torch.ones(10, dtype=torch.uint8)] * 6
    keys = [f"c.k{i}" for i in range(6)]
    assert all(store.batch_io_v1(IoOp.SET, keys, bufs))
    backend = store.backend
    assert backend._executor is not None
    store.close()
    backend.hicache_close()
    assert backend._executor is None
    # after close the backend still answers (inline), it just has no threads
    assert backend.hicache_batch_io_v1(op=IoOp.EXISTS, keys=keys, buffers=None) == [True] * 6


def test_root_with_foreign_content_is_refused(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("not a page")
    with pytest.raises(FileRootError, match="not empty"):
        open_store(config(tmp_path, options={"max_bytes": 1}))
    assert (tmp_path / "precious.txt").read_text() == "not a page"


def test_shard_that_is_a_file_fails_only_its_pages(tmp_path: Path) -> None:
    """A regular file where a shard directory should be: ENOTDIR for its keys, nothing left behind."""
    data = [torch.full((500,), i, dtype=torch.uint8) for i in range(3)]
    with open_store(config(tmp_path)) as store:
        backend = store.backend
        bad = os.path.dirname(backend.path_of("x.key-abc"))
        os.makedirs(os.path.dirname(bad), exist_ok=True)
        Path(bad).write_bytes(b"not a directory")
        res = store.batch_io_v1(IoOp.SET, ["x.key-abc", "x.key-abd", "x.other-abc"], data)
        assert res == [False, True, False]
        assert backend.stats.write_errors == 2 and backend.stats.writes == 1
        assert not temp_files(tmp_path)
        assert store.batch_io_v1(IoOp.EXISTS, ["x.key-abc", "x.key-abd"]) == [False, True]


def test_page_that_is_a_directory_is_a_read_error(tmp_path: Path) -> None:
    with open_store(config(tmp_path)) as store:
        backend = store.backend
        good = torch.arange(64, dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.SET, ["d.good"], [good]) == [True]
        os.makedirs(backend.path_of("d.dir"))
        out = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
        assert store.batch_io_v1(IoOp.GET, ["d.dir", "d.good"], out) == [False, True]
        assert torch.equal(out[1], good)
        assert backend.stats.read_errors == 1 and backend.stats.integrity_errors == 0
