"""POSIX layout: a segment file that is gone (deleted, or replaced by a symlink, which is never
followed) costs its pages once: they read as misses, are dropped from the index, and the next
backup stores them again for every store.

The scenario runs in a child process: in this test process, a NIXL OBJ plugin created after it
was refused by NIXL ("unsupported backend 'OBJ'"), which would fail the OBJ tests that follow."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCENARIO = r"""
import glob, os, shutil, sys
import torch
import hicache_core as hc

root, outside, how = sys.argv[1], sys.argv[2], sys.argv[3]
N = 8

def controller():
    cfg = hc.StorageConfig(backend="nixl", options={"plugin": "posix", "root": root}, model_name="m")
    kv = hc.MHAKVPool(num_pages=32, page_size=4, num_layers=2, num_heads=2, head_dim=64)
    return hc.CacheController(cfg, hc.HostPoolGroup(kv)), kv

hashes = hc.page_hashes(list(range(N * 4)), page_size=4)
ctl, kv = controller()
for buf in kv.buffers():
    buf.view(torch.uint8).fill_(1)
assert ctl.backup(hashes, list(range(N))).pages == N
ctl.close()
segments = [p for p in glob.glob(root + "/**", recursive=True) if os.path.isfile(p) and "index" not in p]
assert segments
for seg in segments:
    if how == "symlink":  # the same bytes, outside the root: never read through the link
        copy = os.path.join(outside, os.path.basename(seg))
        shutil.copyfile(seg, copy)
        os.unlink(seg)
        os.symlink(copy, seg)
    else:
        os.unlink(seg)
ctl, kv = controller()
assert ctl.prefetch(hashes, list(range(16, 16 + N))).pages == 0
for buf in kv.buffers():
    buf.view(torch.uint8).fill_(2)
assert ctl.query(hashes).pages == 0, "dropped pages still reported stored"
assert ctl.backup(hashes, list(range(N))).pages == N
ctl.close()
ctl, kv = controller()
got = ctl.prefetch(hashes, list(range(16, 16 + N))).pages
assert got == N, f"a fresh store read {got} of the {N} pages stored again"
assert all(int(kv.page_views([16 + i])[0][0][0]) == 2 for i in range(N))
ctl.close()
print("ok")
"""


@pytest.mark.parametrize("how", ["deleted", "symlink"])
def test_pages_of_a_lost_segment_are_stored_again(tmp_path, how: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _SCENARIO, str(tmp_path / "root"), str(outside), how],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
