"""The file backend never leaves its root (issue "Never the wrong KV, never outside the root",
items 7, 8 and 11).

Each test drives the real file backend through public names only (``hicache_core``, the
``hicache_file`` options, ``store.backend``'s hooks) and injects nothing but planted
symlinks, a bad key, a killed writer or a full filesystem. Every test snapshots a directory
*around* the root and fails if anything outside the root was created, changed or deleted.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hicache_core as hc
from hicache_core import IoOp, KeyFormatError, PoolName, PoolTransfer

pytest.importorskip("hicache_file")

pytestmark = pytest.mark.timeout(180)


def _cfg(root: Path, **options: Any) -> hc.StorageConfig:
    return hc.StorageConfig(backend="file", options={"root": str(root), **options}, model_name="safety")


def _snapshot(path: Path, skip: Path | None = None) -> dict[str, tuple[int, int, bytes]]:
    """Every entry below ``path`` (except below ``skip``): kind, size and content of files."""
    out: dict[str, tuple[int, int, bytes]] = {}
    for dirpath, dirs, files in os.walk(path):
        if skip is not None and Path(dirpath) == skip:
            dirs[:] = []
            continue
        for name in dirs + files:
            p = Path(dirpath) / name
            if skip is not None and p == skip:
                continue
            st = p.lstat()
            data = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
            out[str(p.relative_to(path))] = (st.st_mode & 0o170000, st.st_size, data)
    return out


def _hashes(n: int, start: int = 0) -> list[str]:
    return hc.page_hashes(list(range(start * 4, (start + n) * 4)), 4)


class Around:
    """``tmp/around/root`` (the backend's root) next to ``tmp/around/outside``."""

    def __init__(self, tmp: Path) -> None:
        self.around = tmp / "around"
        self.root = self.around / "root"
        self.outside = self.around / "outside"
        self.outside.mkdir(parents=True)
        (self.around / "neighbour.txt").write_text("do not touch")

    def outside_root(self) -> dict[str, tuple[int, int, bytes]]:
        return _snapshot(self.around, skip=self.root)


# ----------------------------------------------------------------- item 7: writes
@pytest.mark.parametrize("where", ["namespace", "shard"])
def test_symlinked_directory_never_receives_a_backup(tmp_path: Path, where: str) -> None:
    """A symlink planted in place of a namespace or shard directory is never written through."""
    fx = Around(tmp_path)
    kv = hc.MHAKVPool(4, 4, 1, 1, 8)
    hashes = _hashes(4)
    with hc.CacheController(_cfg(fx.root), kv) as ctl:
        keys = [k for ks in ctl.store.page_keys(PoolName.KV, hashes) for k in ks]
        ns = keys[0].split(".")[0]
        if where == "namespace":
            os.symlink(fx.outside, fx.root / ns)
        else:
            (fx.root / ns).mkdir()
            for shard in {k[-1] for k in keys}:
                os.symlink(fx.outside, fx.root / ns / shard)
        before = fx.outside_root()
        result = ctl.backup(hashes, range(4))
        after = fx.outside_root()
    assert after == before, f"the backup wrote outside the root: {sorted(set(after) ^ set(before))[:4]}"
    assert result.pages == 0, "pages behind a symlink must not be reported stored"


# ----------------------------------------------------- item 7: clear and eviction
def test_clear_never_descends_through_a_symlinked_namespace(tmp_path: Path) -> None:
    fx = Around(tmp_path)
    kv = hc.MHAKVPool(2, 4, 1, 1, 8)
    with hc.CacheController(_cfg(fx.root), kv) as ctl:
        keys = [k for ks in ctl.store.page_keys(PoolName.KV, _hashes(2)) for k in ks]
        ns = keys[0].split(".")[0]
        for k in keys:  # files named exactly like this namespace's pages, outside the root
            (fx.outside / k[-1]).mkdir(exist_ok=True)
            (fx.outside / k[-1] / k).write_bytes(b"precious")
        os.symlink(fx.outside, fx.root / ns)
        before = fx.outside_root()
        cleared = ctl.clear()
        after = fx.outside_root()
    assert after == before, f"clear deleted outside the root: {sorted(set(before) - set(after))[:4]}"
    assert cleared == 0


@pytest.mark.parametrize("where", ["namespace", "shard"])
def test_eviction_never_follows_a_symlink(tmp_path: Path, where: str) -> None:
    """Pages are indexed, then their directory is swapped for a symlink to files of the same
    names outside the root; the LRU eviction that follows must not delete those files."""
    fx = Around(tmp_path)
    size = 4096
    disk = 4096 + 64  # payload + header (the key fits one 64-byte header block)
    old = [f"ev.p{i:03d}a" for i in range(4)]  # shard "a" of namespace "ev"
    new = [f"other.p{i:03d}b" for i in range(4)]
    bufs = [torch.full((size,), i, dtype=torch.uint8) for i in range(4)]
    with hc.open_store(_cfg(fx.root, max_bytes=6 * disk)) as store:
        assert store.batch_io_v1(IoOp.SET, old, bufs) == [True] * 4
        victim = fx.outside / "a" if where == "namespace" else fx.outside
        victim.mkdir(exist_ok=True)
        for k in old:
            (victim / k).write_bytes(b"precious")
        if where == "namespace":
            shutil.rmtree(fx.root / "ev")
            os.symlink(fx.outside, fx.root / "ev")
        else:
            shutil.rmtree(fx.root / "ev" / "a")
            os.symlink(fx.outside, fx.root / "ev" / "a")
        before = fx.outside_root()
        time.sleep(0.01)
        assert store.batch_io_v1(IoOp.SET, new, bufs) == [True] * 4  # over budget: evicts old pages
        after = fx.outside_root()
    assert after == before, f"eviction deleted outside the root: {sorted(set(before) - set(after))[:4]}"


# -------------------------------------------------------- item 8: str subclass keys
class _Sneaky(str):
    """A key whose characters are valid but whose ``__str__``/``__fspath__`` name another file."""

    target = ""

    def __str__(self) -> str:
        return self.target

    def __fspath__(self) -> str:
        return self.target


def _sneaky(key: str, target: str) -> _Sneaky:
    s = _Sneaky(key)
    s.target = target
    return s


@pytest.mark.parametrize("hook", ["v1", "v2"])
def test_str_subclass_key_is_refused_at_the_hook(tmp_path: Path, hook: str) -> None:
    """The backend's own hook (not the controller) refuses a key that is not an exact ``str``."""
    fx = Around(tmp_path)
    kv = hc.MHAKVPool(2, 4, 1, 1, 8)
    with hc.CacheController(_cfg(fx.root), kv) as ctl:
        backend = ctl.store.backend
        before = fx.outside_root()
        outcomes = []
        for i, escape in enumerate(["../../../escaped-{}", str(fx.outside / "escaped-{}")]):
            k = f"sneaky.kv.k.tp0of1.page{i}x"
            v = f"sneaky.kv.v.tp0of1.page{i}x"
            keys = (_sneaky(k, escape.format(f"k{i}")), _sneaky(v, escape.format(f"v{i}")))
            try:
                if hook == "v1":
                    views = kv.page_views([0])[0]
                    out: Any = backend.hicache_batch_io_v1(op=IoOp.SET, keys=list(keys), buffers=list(views))
                else:
                    t = PoolTransfer(PoolName.KV, [0], [f"page{i}x"], keys=[keys])
                    out = backend.hicache_batch_io_v2(op=IoOp.SET, transfers=[t])
            except KeyFormatError:
                out = "refused"
            outcomes.append(out)
        after = fx.outside_root()
    assert after == before, f"a str-subclass key wrote outside the root: {sorted(set(after) - set(before))}"
    assert outcomes == ["refused", "refused"], outcomes


# ------------------------------------------------ item 11: orphans of a killed writer
_WRITER = textwrap.dedent(
    """
    import sys, torch
    from hicache_core import IoOp, StorageConfig, open_store
    opts = {"root": sys.argv[1], "publish": "rename", "io_threads": 1}
    store = open_store(StorageConfig(backend="file", options=opts))
    buf = torch.ones(8 << 20, dtype=torch.uint8)
    print("ready", flush=True)
    i = int(sys.argv[2])
    while True:
        store.batch_io_v1(IoOp.SET, [f"crash.p{i:07d}"], [buf])
        i += 1
    """
)


def _temp_files(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob(".tmp-*")]


def test_temp_files_of_a_killed_rename_writer_are_removed_at_open(tmp_path: Path) -> None:
    root = tmp_path / "root"
    orphans: list[str] = []
    for attempt in range(10):  # SIGKILL until the writer dies holding a temp file
        child = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(root), str(attempt * 100_000)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(0.3)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
            if child.stdout is not None:
                child.stdout.close()
        orphans = _temp_files(root)
        if orphans:
            break
    assert orphans, "the writer never died holding a temp file; the test proves nothing"
    with hc.open_store(_cfg(root)) as store:  # default options: no max_bytes scan
        left = _temp_files(root)
        assert store.batch_io_v1(IoOp.EXISTS, ["crash.p0000000"]) == [True]
    assert left == [], f"orphan temp files survived the open: {left}"


# ----------------------------------------------- item 11: the format marker, disk full
@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs filled to the last byte (needs root to mount; skipped otherwise)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        with open(mnt / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as err:
                assert err.errno == errno.ENOSPC
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_open_on_a_full_disk_leaves_no_marker_temp(full_fs: Path) -> None:
    root = full_fs / "root"
    outcome: object
    try:
        hc.open_store(_cfg(root)).close()
        outcome = "opened"
    except OSError as err:  # FileRootError is an OSError (BackendIOError)
        outcome = err
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())
    assert left == [], f"a failed open left files behind: {left}"
    from hicache_file import FileRootError

    assert isinstance(outcome, FileRootError), outcome
    assert "No space left" in str(outcome)
