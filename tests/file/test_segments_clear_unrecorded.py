"""Segments layout: a clear whose CLEAR record cannot be written (disk full) fails and clears
nothing, in this store and in every other, instead of reporting success while other and later
stores keep serving the pages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import hicache_core as hc


def _cfg(root: Path) -> hc.StorageConfig:
    return hc.StorageConfig(
        backend="file", options={"root": str(root), "layout": "segments"}, model_name="clear-enospc"
    )


def test_unrecorded_clear_fails_and_clears_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashes = hc.page_hashes(list(range(16)), 4)
    kv = hc.MHAKVPool(8, 4, 1, 1, 8, torch.float16)
    with hc.CacheController(_cfg(tmp_path), kv) as ctl:
        assert ctl.backup(hashes, [0, 1, 2, 3]).pages == 4
        segments = ctl.store.backend.segments
        full = os.open("/dev/full", os.O_WRONLY)
        try:
            monkeypatch.setattr(segments, "_open_log", lambda: full)
            with pytest.raises(hc.BackendIOError, match="nothing was cleared"):
                ctl.clear()
        finally:
            monkeypatch.undo()
            os.close(full)
        assert ctl.query(hashes).pages == 4  # still served here: nothing was cleared
        with hc.CacheController(_cfg(tmp_path), hc.MHAKVPool(8, 4, 1, 1, 8, torch.float16)) as other:
            assert other.query(hashes).pages == 4
        assert ctl.clear() == 4 * 2  # recorded now: K and V of each page
        assert ctl.query(hashes).pages == 0
    with hc.CacheController(_cfg(tmp_path), hc.MHAKVPool(8, 4, 1, 1, 8, torch.float16)) as later:
        assert later.query(hashes).pages == 0
