"""``fsync=True``: every page and every touched directory is synced before success is reported."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from file_helpers import config, files_under, fill, pages, zero

from hicache_core import CacheController, MHAKVPool, page_hashes


@pytest.mark.parametrize("publish", ["tmpfile", "rename"])
def test_fsync_pages_and_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, publish: str) -> None:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    kv = MHAKVPool(6, 2, 2, 1, 8)
    fill(kv, 5)
    want = pages(kv, range(6))
    hashes = page_hashes(list(range(12)), 2)
    with CacheController(config(tmp_path, options={"fsync": True, "publish": publish}), kv) as ctl:
        monkeypatch.setattr(os, "fsync", fsync)
        assert ctl.backup(hashes, range(6)).ok
        monkeypatch.undo()
        namespace = ctl.store.keys.scheme.namespace
        zero(kv)
        assert ctl.prefetch(hashes, range(6)).pages == 6
    assert pages(kv, range(6)) == want
    # an O_TMPFILE inode reads as "<shard>/#<ino> (deleted)"; a temp file (rename) as
    # "<root>/.hicache-tmp/.tmp-..."
    page_syncs = [p for p in synced if not os.path.isdir(p)]
    assert len(page_syncs) == 12, "each component file is synced before it is published"
    dirs = {p for p in synced if os.path.isdir(p)}
    shards = {os.path.dirname(str(tmp_path / f)) for f in files_under(tmp_path)}
    assert len(shards) > 1 and shards <= dirs, "each shard directory is synced after the links/renames"
    assert str(tmp_path / namespace) in dirs and str(tmp_path) in dirs, "new directories are made durable"
