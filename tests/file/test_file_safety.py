"""Path safety of the file backend: no symlink below the root is followed, keys are exact str
at the hooks, orphan temp files go at open, cached directory fds survive clears elsewhere.

The acceptance tests (each fails on the code before this change) are in
``tests/reliability/test_path_safety.py``; these cover the rest of the behaviour.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from file_helpers import config, files_under
from hicache_file import FileRootError, _publish
from hicache_file import _format as fmt

from hicache_core import IoOp, KeyFormatError, open_store


def _buf(i: int, n: int = 256) -> torch.Tensor:
    return torch.full((n,), i, dtype=torch.uint8)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_page_symlink_is_never_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A symlink at a page's name, even to a valid page of that very key, is not read."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    with open_store(config(root)) as store:
        assert store.batch_io_v1(IoOp.SET, ["s.key1"], [_buf(7)]) == [True]
        page = Path(store.backend.path_of("s.key1"))
        os.replace(page, outside / "s.key1")  # a valid page of this key, outside the root
        os.symlink(outside / "s.key1", page)
        out = torch.zeros(256, dtype=torch.uint8)
        with caplog.at_level(logging.WARNING, logger="hicache.file"):
            assert store.batch_io_v1(IoOp.GET, ["s.key1"], [out]) == [False]
        assert not out.any(), "nothing was read through the symlink"
        assert store.backend.stats.integrity_errors == 1
        assert not page.is_symlink() and not page.exists(), "the symlink (not its target) is removed"
        assert "a symlink, not a page" in caplog.text
        assert (outside / "s.key1").stat().st_size > 256, "the target is untouched"
        assert store.batch_io_v1(IoOp.SET, ["s.key1"], [_buf(7)]) == [True]  # rewritten in place
        assert store.batch_io_v1(IoOp.GET, ["s.key1"], [out]) == [True] and torch.equal(out, _buf(7))


def test_dangling_page_symlink_is_replaced_by_a_rename_writer(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    with open_store(config(root, options={"publish": "rename"})) as store:
        path = Path(store.backend.path_of("r.key9"))
        path.parent.mkdir(parents=True)
        os.symlink(outside / "target", path)
        # exists() does not follow the link: the name is taken, so set skips it like a damaged
        # page; the get that follows removes it and the next set writes the page
        assert store.batch_io_v1(IoOp.EXISTS, ["r.key9"]) == [True]
        out = torch.zeros(256, dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.GET, ["r.key9"], [out]) == [False]
        assert store.batch_io_v1(IoOp.SET, ["r.key9"], [_buf(3)]) == [True]
        assert path.is_file() and not path.is_symlink()
    assert list(outside.iterdir()) == []


def test_fifo_at_a_page_name_does_not_block_a_reader(tmp_path: Path) -> None:
    with open_store(config(tmp_path)) as store:
        path = Path(store.backend.path_of("f.key1"))
        path.parent.mkdir(parents=True)
        os.mkfifo(path)
        out = torch.zeros(256, dtype=torch.uint8)
        t0 = time.monotonic()
        assert store.batch_io_v1(IoOp.GET, ["f.key1"], [out]) == [False]
        assert time.monotonic() - t0 < 5
        assert not path.exists(), "the FIFO is removed like any damaged page"


@pytest.mark.parametrize("publish", ["tmpfile", "rename"])
def test_symlinked_shard_fails_its_keys_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, publish: str
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    with open_store(config(root, options={"publish": publish})) as store:
        shard = Path(store.backend.path_of("x.key-abc")).parent
        shard.parent.mkdir(parents=True)
        os.symlink(outside, shard)
        keys = ["x.key-abc", "x.key-abd"]
        with caplog.at_level(logging.WARNING, logger="hicache.file"):
            assert store.batch_io_v1(IoOp.SET, keys, [_buf(1), _buf(2)]) == [False, True]
        assert "is a symlink; hicache-file never follows symlinks below its root" in caplog.text
        assert store.batch_io_v1(IoOp.EXISTS, keys) == [False, True]
        outs = [torch.zeros(256, dtype=torch.uint8) for _ in keys]
        assert store.batch_io_v1(IoOp.GET, keys, outs) == [False, True]
        assert store.backend.stats.read_errors == 1 and store.backend.stats.write_errors == 1
        assert store.backend.hicache_clear(namespace="x") == 1
    assert list(outside.iterdir()) == []
    assert shard.is_symlink(), "clear never removes (nor descends through) a symlink"


def test_root_given_through_a_symlink(tmp_path: Path) -> None:
    """The operator's root may be a symlink: it is resolved once, at open."""
    real = tmp_path / "disk" / "cache"
    real.mkdir(parents=True)
    link = tmp_path / "cache-link"
    os.symlink(real, link)
    with open_store(config(link, options={"max_bytes": "1MiB"})) as store:
        assert store.backend.root == str(real)
        assert store.batch_io_v1(IoOp.SET, ["l.k1", "l.k2"], [_buf(1), _buf(2)]) == [True, True]
    assert sorted(files_under(real)) == ["l/1/l.k1", "l/2/l.k2"]
    with open_store(config(link, options={"max_bytes": "1MiB"})) as store:
        assert store.backend.index is not None and len(store.backend.index) == 2
        assert store.batch_io_v1(IoOp.EXISTS, ["l.k1", "l.k2"]) == [True, True]
        assert store.backend.hicache_clear(namespace="l") == 2


def test_symlinked_marker_or_temp_dir_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "marker.json").write_text(json.dumps({"format": 2, "layout": fmt.LAYOUT}))
    root.mkdir()
    os.symlink(outside / "marker.json", root / fmt.MARKER_NAME)
    with pytest.raises(FileRootError, match="is a symlink"):
        open_store(config(root))
    os.unlink(root / fmt.MARKER_NAME)
    open_store(config(root)).close()
    os.symlink(outside, root / fmt.TEMP_DIR)
    with pytest.raises(FileRootError, match="is a symlink"):
        open_store(config(root, options={"publish": "rename"}))
    assert list(outside.iterdir()) == [outside / "marker.json"]


def test_scan_never_descends_through_symlinks(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "1").mkdir(parents=True)
    (outside / "1" / "o.k1").write_bytes(b"x" * 100)
    (outside / "o.k2").write_bytes(b"x" * 100)
    with open_store(config(root)) as store:
        assert store.batch_io_v1(IoOp.SET, ["n.k1"], [_buf(1)]) == [True]
        page = Path(store.backend.path_of("n.k1"))
    os.symlink(outside, root / "o")  # a namespace
    (page.parent.parent / "2").mkdir()
    os.symlink(outside / "o.k2", page.parent.parent / "2" / "n.k2")  # a page
    with open_store(config(root, options={"max_bytes": 1})) as store:  # evicts all it indexed
        assert store.backend.stats.evictions == 1
    assert (outside / "1" / "o.k1").exists() and (outside / "o.k2").exists()


def test_temp_files_of_dead_writers_go_at_open(tmp_path: Path) -> None:
    with open_store(config(tmp_path, options={"publish": "rename"})) as store:
        assert store.batch_io_v1(IoOp.SET, ["t.k1"], [_buf(1)]) == [True]
    tmpdir = tmp_path / fmt.TEMP_DIR
    assert tmpdir.is_dir() and list(tmpdir.iterdir()) == []
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = _publish.HOST
    assert host, "this test needs /proc"
    names = {
        "dead": f".tmp-{host}-{dead.pid}-abcd-0",
        "live": f".tmp-{host}-{os.getpid()}-abcd-0",
        "elsewhere-young": ".tmp-0badc0de-1-abcd-0",
        "elsewhere-old": ".tmp-0badc0de-2-abcd-0",
        "old-format": ".tmp-deadbeef-3-0",
    }
    for n in names.values():
        (tmpdir / n).write_bytes(b"partial")
    (tmp_path / f"{fmt.MARKER_NAME}.123-abc").write_bytes(b"")  # an interrupted open, old-style
    past = time.time() - 7200
    for n in ("elsewhere-old", "old-format"):
        os.utime(tmpdir / names[n], (past, past))
    os.utime(tmp_path / f"{fmt.MARKER_NAME}.123-abc", (past, past))
    with open_store(config(tmp_path)) as store:  # tmpfile mode sweeps too; no max_bytes
        assert store.backend.stats.temp_files_removed == 4
    assert sorted(p.name for p in tmpdir.iterdir()) == sorted([names["live"], names["elsewhere-young"]])
    assert not (tmp_path / f"{fmt.MARKER_NAME}.123-abc").exists()


def test_rename_writer_killed_mid_write_leaves_nothing_after_reopen(tmp_path: Path) -> None:
    """Temp files live in one directory, so the open-time sweep costs one scandir of it."""
    code = (
        "import sys, torch, hicache_core as hc\n"
        "s = hc.open_store(hc.StorageConfig(backend='file', options={'root': sys.argv[1], "
        "'publish': 'rename', 'io_threads': 1}))\n"
        "print('ready', flush=True)\n"
        "b = torch.ones(4 << 20, dtype=torch.uint8)\n"
        "i = 0\n"
        "while True:\n"
        "    s.batch_io_v1('set', [f'k.p{i}'], [b]); i += 1\n"
    )
    for _ in range(10):
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stdout.close()
        if list((tmp_path / fmt.TEMP_DIR).iterdir()):
            break
    assert list((tmp_path / fmt.TEMP_DIR).iterdir()), "no temp file left: the test proves nothing"
    assert not [p for p in files_under(tmp_path) if "/.tmp-" in p and not p.startswith(fmt.TEMP_DIR)]
    with open_store(config(tmp_path, options={"publish": "rename"})) as store:
        assert store.backend.stats.temp_files_removed >= 1
    assert list((tmp_path / fmt.TEMP_DIR).iterdir()) == []


# ------------------------------------------------------------- keys at the hooks
class _Str(str):
    def __str__(self) -> str:
        return "../escape"

    def __fspath__(self) -> str:
        return "../escape"


def test_str_subclass_equal_to_a_known_key_is_refused(tmp_path: Path) -> None:
    """The memo of validated keys cannot be used to slip a subclass past the check."""
    with open_store(config(tmp_path / "root")) as store:
        backend = store.backend
        assert store.batch_io_v1(IoOp.SET, ["m.key1"], [_buf(1)]) == [True]
        for op in (IoOp.EXISTS, IoOp.GET, IoOp.SET):
            bufs = None if op is IoOp.EXISTS else [_buf(0)]
            with pytest.raises(KeyFormatError, match="must be a str"):
                backend.hicache_batch_io_v1(op=op, keys=[_Str("m.key1")], buffers=bufs)
            with pytest.raises(KeyFormatError):  # in a batch with valid keys too
                backend.hicache_batch_io_v1(
                    op=op, keys=["m.key1", _Str("m.key2")], buffers=None if bufs is None else bufs * 2
                )
        with pytest.raises(KeyFormatError):
            backend.hicache_clear(namespace=_Str("m"))
        with pytest.raises(KeyFormatError):
            backend.path_of(_Str("m.key1"))
        assert "m.key2" not in backend._path_cache
    assert sorted(os.listdir(tmp_path)) == ["root"]


# -------------------------------------------------------- cached directory fds
@pytest.mark.parametrize("publish", ["tmpfile", "rename"])
def test_directories_removed_by_another_store_are_reopened(tmp_path: Path, publish: str) -> None:
    """Store A caches its directory fds; store B (another process, say) clears the namespace,
    removing those directories, and writes the pages again: A still reads, writes and checks
    existence by name, in the new directories."""
    keys = [f"ns.p{i:03d}{'abcdef'[i % 6]}" for i in range(24)]
    bufs = [_buf(i) for i in range(24)]
    a = open_store(config(tmp_path, options={"publish": publish, "io_threads": 1}))
    b = open_store(config(tmp_path, options={"publish": publish, "io_threads": 1}))
    try:
        assert all(a.batch_io_v1(IoOp.SET, keys, bufs))
        assert b.backend.hicache_clear(namespace="ns") == 24
        assert not (tmp_path / "ns").exists()
        assert a.batch_io_v1(IoOp.EXISTS, keys) == [False] * 24
        assert all(b.batch_io_v1(IoOp.SET, keys[:12], bufs[:12]))  # new directories
        assert a.batch_io_v1(IoOp.EXISTS, keys) == [True] * 12 + [False] * 12
        outs = [torch.zeros(256, dtype=torch.uint8) for _ in keys]
        assert a.batch_io_v1(IoOp.GET, keys, outs) == [True] * 12 + [False] * 12
        assert all(torch.equal(o, w) for o, w in zip(outs[:12], bufs[:12]))
        assert b.backend.hicache_clear(namespace="ns") == 12
        assert all(a.batch_io_v1(IoOp.SET, keys, bufs))  # A writes into directories it makes again
        outs = [torch.zeros(256, dtype=torch.uint8) for _ in keys]
        assert b.batch_io_v1(IoOp.GET, keys, outs) == [True] * 24
        assert a.backend.stats.write_errors == 0 and a.backend.stats.read_errors == 0
    finally:
        a.close()
        b.close()


def test_no_fd_leak_and_a_closed_store_still_answers(tmp_path: Path) -> None:
    before = _open_fds()
    for i in range(30):
        with open_store(config(tmp_path, options={"io_threads": 1})) as store:
            keys = [f"ns{i % 3}.k{j}" for j in range(16)]
            assert all(store.batch_io_v1(IoOp.SET, keys, [_buf(j) for j in range(16)]))
    assert _open_fds() <= before + 1
    store = open_store(config(tmp_path))
    backend = store.backend
    store.close()
    assert _open_fds() <= before + 1, "close releases the directory fds"
    assert backend.hicache_batch_io_v1(op=IoOp.EXISTS, keys=["ns0.k1", "ns0.kx"], buffers=None) == [
        True,
        False,
    ]
    del store, backend


def test_directory_fds_are_bounded(tmp_path: Path) -> None:
    """Keys naming many namespaces never hold more than MAX_OPEN directory fds."""
    from hicache_file._dirs import MAX_OPEN

    before = _open_fds()
    with open_store(config(tmp_path, options={"io_threads": 1})) as store:
        for i in range(0, 400, 20):
            keys = [f"n{j}.key{j % 16:x}" for j in range(i, i + 20)]
            assert all(store.batch_io_v1(IoOp.SET, keys, [_buf(1)] * 20))
            assert _open_fds() - before <= MAX_OPEN + 45
        keys = [f"n{j}.key{j % 16:x}" for j in range(400)]
        assert store.batch_io_v1(IoOp.EXISTS, keys) == [True] * 400
