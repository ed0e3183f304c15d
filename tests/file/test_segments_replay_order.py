"""Segment layout: the newest record of a key wins whatever order the index logs are read in.

A page whose segment was damaged is rewritten by the next store into its own (newer) log; a store
opened afterwards must serve the rewrite, not fall back on the damaged record of the old log.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator

import pytest
import torch

import hicache_core as hc

N = 8


def _controller(root: str) -> tuple[hc.CacheController, hc.MHAKVPool]:
    cfg = hc.StorageConfig(backend="file", options={"root": root, "layout": "segments"}, model_name="m")
    kv = hc.MHAKVPool(num_pages=32, page_size=4, num_layers=2, num_heads=2, head_dim=64)
    return hc.CacheController(cfg, hc.HostPoolGroup(kv)), kv


@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_rewritten_page_wins_over_its_damaged_record(tmp_path, monkeypatch, order: str) -> None:
    root = str(tmp_path / "root")
    hashes = hc.page_hashes(list(range(N * 4)), page_size=4)
    ctl, kv = _controller(root)
    for buf in kv.buffers():
        buf.view(torch.uint8).fill_(1)
    assert ctl.backup(hashes, list(range(N))).pages == N
    ctl.close()
    for seg in glob.glob(root + "/segments/*.seg"):  # damage every stored byte
        with open(seg, "r+b") as f:
            f.write(b"\0" * os.path.getsize(seg))

    ctl, kv = _controller(root)
    assert ctl.prefetch(hashes, list(range(16, 16 + N))).pages == 0  # damaged: misses
    for buf in kv.buffers():
        buf.view(torch.uint8).fill_(2)
    assert ctl.backup(hashes, list(range(N))).pages == N  # rewritten into this store's log
    ctl.close()

    real = os.scandir

    @contextlib.contextmanager
    def ordered(path: object) -> Iterator[list[os.DirEntry[str]]]:
        with real(path) as it:  # type: ignore[call-overload]
            entries = sorted(it, key=lambda e: e.name, reverse=order == "reversed")
        yield entries

    monkeypatch.setattr(os, "scandir", ordered)
    ctl, kv = _controller(root)
    try:
        got = ctl.prefetch(hashes, list(range(16, 16 + N)))
        assert got.pages == N, f"logs read {order}: the rewritten pages must be served, got {got}"
        assert all(bool((v == 2).all()) for page in kv.page_views(range(16, 16 + N)) for v in page)
    finally:
        ctl.close()
