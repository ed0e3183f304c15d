"""Disk full (file backend): failing pages are reported per page, stored pages stay readable.

Both layouts, two variants: a real 2 MiB tmpfs mounted in the test (skipped with the reason when
mounting is impossible), and an injected ``ENOSPC`` from the write calls that always runs; plus,
for the segment layout, a full index log while the data still fits. Every page reported stored
reads back byte-exact, in the same store and in a fresh one.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import hicache_core as hc
from tests.reliability._util import (
    GEOMETRY,
    HAVE_FILE,
    fill_pages,
    hex_hash,
    page_matches,
    report,
    temp_files,
)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed"),
]
BATCH = 16


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill_until_full(root: Path, caplog, batches: int, layout: str = "files") -> dict[str, object]:
    kv = hc.MHAKVPool(BATCH, **GEOMETRY)
    cfg = hc.StorageConfig(
        backend="file", options={"root": str(root), "layout": layout}, model_name="diskfull"
    )
    stored: list[str] = []
    failed = partial_batches = 0
    with hc.CacheController(cfg, hc.HostPoolGroup(kv)) as ctl:
        for b in range(batches):
            hashes = [hex_hash("diskfull", b * BATCH + i) for i in range(BATCH)]
            fill_pages(kv, range(BATCH), hashes)
            res = ctl.backup(hashes, range(BATCH))
            ok = res.per_pool[hc.PoolName.KV]
            stored += [h for h, f in zip(hashes, ok) if f]
            failed += ok.count(False)
            partial_batches += 0 < ok.count(False) < BATCH
            assert not res.errors or all("backend 'file'" in e for e in res.errors)
        stats = ctl.store.backend.stats
        # every page acknowledged earlier still reads back byte-exact (fresh host slots)
        readable = 0
        for s in range(0, len(stored), BATCH):
            part = stored[s : s + BATCH]
            for buf in kv.buffers():
                buf.fill_(0)
            got = ctl.prefetch(part, range(len(part)))
            readable += sum(1 for i, h in enumerate(part[: got.pages]) if page_matches(kv, i, h))
    reopened = 0  # and from a fresh store, which knows only what reached the disk
    with hc.CacheController(cfg, hc.HostPoolGroup(kv)) as ctl:
        for s in range(0, len(stored), BATCH):
            part = stored[s : s + BATCH]
            for buf in kv.buffers():
                buf.fill_(0)
            got = ctl.prefetch(part, range(len(part)))
            reopened += sum(1 for i, h in enumerate(part[: got.pages]) if page_matches(kv, i, h))
    reasons = [
        r.getMessage() for r in caplog.records if r.name == "hicache.file" and "failed" in r.getMessage()
    ]
    return {
        "attempted": batches * BATCH,
        "stored": len(stored),
        "failed": failed,
        "partial_batches": partial_batches,
        "readable": readable,
        "readable_after_reopen": reopened,
        "write_errors": stats.write_errors,
        "enospc_logged": sum("No space left" in m or f"Errno {errno.ENOSPC}" in m for m in reasons),
        "temp_files_left": len(temp_files(root)),
    }


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_tmpfs_full(small_fs: Path, caplog, record_property, layout: str) -> None:
    caplog.set_level(logging.WARNING, logger="hicache.file")
    counts = _fill_until_full(small_fs / "root", caplog, batches=8, layout=layout)  # 128 x 32 KiB > 2 MiB
    report(record_property, f"disk-full-tmpfs-{layout}", **counts)
    assert counts["stored"] > 0 and counts["failed"] > 0
    assert counts["readable"] == counts["readable_after_reopen"] == counts["stored"]
    assert counts["write_errors"] > 0 and counts["enospc_logged"] > 0
    assert counts["temp_files_left"] == 0


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_injected_enospc(tmp_path: Path, caplog, monkeypatch, record_property, layout: str) -> None:
    """Page data writes fail with ENOSPC (or write short, then fail) after a byte budget
    (``os.writev``; segments: ``os.pwritev`` and preallocation, while the index log still takes
    appends: a page whose data failed must not be recorded; the full log has its own test)."""
    caplog.set_level(logging.WARNING, logger="hicache.file")
    budget = {"left": 80 * (16 << 10)}  # about 80 component objects (40 pages) fit

    def budgeted(real):  # type: ignore[no-untyped-def]
        def call(fd: int, buffers: list, *offset: int) -> int:
            total = sum(memoryview(b).nbytes for b in buffers)
            if budget["left"] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if total > budget["left"]:  # a short write: the backend must finish it or fail cleanly
                first = memoryview(buffers[0]).cast("B")[: budget["left"]]
                budget["left"] = 0
                return int(real(fd, [first], *offset))
            budget["left"] -= total
            return int(real(fd, buffers, *offset))

        return call

    monkeypatch.setattr(os, "writev", budgeted(os.writev))
    if layout == "files":
        monkeypatch.setattr(
            os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "injected"))
        )
    else:
        monkeypatch.setattr(os, "pwritev", budgeted(os.pwritev))
        real_fallocate = os.posix_fallocate

        def fallocate(fd: int, offset: int, length: int) -> None:
            if budget["left"] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fallocate(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", fallocate)
    counts = _fill_until_full(tmp_path / "root", caplog, batches=6, layout=layout)
    report(record_property, f"disk-full-injected-{layout}", **counts)
    assert counts["stored"] > 0 and counts["failed"] > 0
    assert counts["readable"] == counts["readable_after_reopen"] == counts["stored"]
    assert counts["write_errors"] >= counts["failed"]  # counted per component key
    assert counts["enospc_logged"] > 0 and counts["temp_files_left"] == 0


def test_injected_enospc_in_the_index_log(tmp_path: Path, caplog, monkeypatch, record_property) -> None:
    """Segment layout: the index log fills up while the data still fits (its second batch
    append is written short, later ones fail): only pages whose records are whole are
    reported stored, and every one of them is there after a reopen."""
    caplog.set_level(logging.WARNING, logger="hicache.file")
    real = os.write
    appends = {"n": 0}

    def write(fd: int, data: bytes) -> int:
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(".log"):
            return real(fd, data)
        appends["n"] += 1  # 1: the header, 2: the first batch's records, 3: the second's
        if appends["n"] == 3:
            return real(fd, memoryview(data)[: len(data) // 2])
        if appends["n"] > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    counts = _fill_until_full(tmp_path / "root", caplog, batches=4, layout="segments")
    report(record_property, "disk-full-index-log", **counts)
    assert counts["stored"] == BATCH and counts["failed"] == 3 * BATCH
    assert counts["readable"] == counts["readable_after_reopen"] == counts["stored"]
    assert counts["enospc_logged"] > 0 and counts["temp_files_left"] == 0
