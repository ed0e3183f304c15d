"""hf3fs after a crash: killed writers' temporary files are removed, new directories are durable.

A writer killed while creating ``P = {prefix}.{rank}.bin`` (possibly a fully preallocated file)
or rewriting its index leaves ``P.tmp.{pid}`` / ``P.idx.tmp.{pid}``. Every open removes those
whose process no longer runs -- never a live process's, never a name that only looks similar,
never the target of a symlink. The directories a store creates have their parents fsynced, so
the first durable pages cannot vanish with their directory in a power loss.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hf3fs_util import config, pattern
from hicache_hf3fs_stub._slotfile import SlotFile

from hicache_core import IoOp, open_store

NB = 4096


def _open(path: Path, **kw: bool) -> SlotFile:
    return SlotFile(path, capacity=NB, num_slots=4, **kw)


def _dead_pids(n: int) -> list[int]:
    """Pids of processes that ran and were reaped (reuse within a test is vanishingly unlikely)."""
    procs = [subprocess.Popen(["true"]) for _ in range(n)]
    for p in procs:
        p.wait()
    return [p.pid for p in procs]


@pytest.fixture
def live_pid() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _temps(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".tmp." in n)


@pytest.mark.parametrize("existing", [True, False], ids=["reopen", "create"])
def test_open_removes_dead_writers_temps_only(tmp_path: Path, live_pid: int, existing: bool) -> None:
    d = tmp_path / "store"
    d.mkdir()
    data = d / "hf.0.bin"
    if existing:
        _open(data).close()
    a, b, c = _dead_pids(3)
    outside = tmp_path / "outside"
    outside.write_bytes(b"not yours")
    removed = [f"hf.0.bin.tmp.{a}", f"hf.0.bin.idx.tmp.{a}", f"hf.0.bin.tmp.{b}"]
    for name in removed[:2]:
        (d / name).write_bytes(b"\0" * 8192)
    (d / removed[2]).symlink_to(outside)  # the link goes, its target stays
    kept = [
        f"hf.0.bin.tmp.{live_pid}",  # a live process's
        f"hf.0.bin.idx.tmp.{live_pid}",
        f"hf.0.bin.tmp.0{a}",  # not a name this code makes
        f"hf.0.bin.tmp.{a}x",
        f"hf.0.bin.tmp.{a}.tmp",
        "hf.0.bin.tmp.0",
        "hf.0.bin.tmp.",
        "hf.0.bin.tmp.99999999999999999999",
        f"hf.1.bin.tmp.{a}",  # another rank's, another prefix's, another file's
        f"xhf.0.bin.tmp.{a}",
        f"hf.0.bin.lock.tmp.{a}",
        f"hf.0.bin.idx.idx.tmp.{a}",
    ]
    for name in kept:
        (d / name).write_bytes(b"keep")
    (d / f"hf.0.bin.idx.tmp.{c}").mkdir()  # a directory of that name: left alone, no error

    sf = _open(data)
    try:
        assert sf.put([("k.a", memoryview(pattern("k.a", NB)))]) == [True]
    finally:
        sf.close()

    left = _temps(d)
    assert [n for n in removed if n in left] == []
    assert sorted([*kept, f"hf.0.bin.idx.tmp.{c}"]) == left
    assert outside.read_bytes() == b"not yours"
    assert all((d / n).read_bytes() == b"keep" for n in kept)


def _killed_writer(path: Path, point: str) -> int:
    """Fork a writer SIGKILLed at ``point``; returns its pid once reaped."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            if point == "fallocate":
                os.posix_fallocate = lambda fd, off, n: os.kill(os.getpid(), signal.SIGKILL)
            else:
                real = os.replace

                def replace(src: str | Path, dst: str | Path) -> None:
                    if str(dst).endswith(".idx"):
                        os.kill(os.getpid(), signal.SIGKILL)
                    real(src, dst)

                os.replace = replace  # type: ignore[assignment]
            _open(path, fallocate=True)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return pid


@pytest.mark.parametrize("point", ["fallocate", "index-rename"])
def test_temp_of_a_killed_writer_is_removed_by_the_next_open(tmp_path: Path, point: str) -> None:
    data = tmp_path / "hf.0.bin"
    pid = _killed_writer(data, point)
    name = f"hf.0.bin.tmp.{pid}" if point == "fallocate" else f"hf.0.bin.idx.tmp.{pid}"
    assert _temps(tmp_path) == [name]  # what the crash left
    sf = _open(data)
    try:
        assert sf.put([("k.a", memoryview(pattern("k.a", NB)))]) == [True]
    finally:
        sf.close()
    assert _temps(tmp_path) == []


def test_failed_index_rewrite_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        if str(dst).endswith(".idx"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        _open(tmp_path / "hf.0.bin")
    assert _temps(tmp_path) == []  # our own pid is live: no later open would remove it


@pytest.mark.parametrize("fsync", [True, False])  # creation is always made durable
def test_new_directories_are_fsynced_in_their_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    synced: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    base = Path(os.path.realpath(tmp_path))
    store = open_store(config(base / "a" / "b" / "hf", options={"bytes_per_page": NB, "fsync": fsync}))
    try:
        page = torch.frombuffer(bytearray(pattern("k.a", NB)), dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.SET, ["k.a"], [page]) == [True]
    finally:
        store.close()
    assert str(base) in synced  # holds the new entry "a"
    assert str(base / "a") in synced  # holds the new entry "b"
    assert synced.index(str(base)) < synced.index(str(base / "a"))  # outermost first
    assert base.parent.as_posix() not in synced  # an existing directory's parent is not touched
