"""Corruption: bit flips and truncations of stored pages are always detected, never returned.

File backend, both layouts: every injected corruption of page bytes (page files; segment data)
must be a miss, counted in ``backend.integrity_errors`` (and so in the metrics extension), and
logged; the page is rewritten by the next backup. Segment layout: a bit flip in an index record
loses that record's page only, a torn index tail only the unfinished records.
hf3fs: bit flips in slot payloads and headers must be misses (its slots carry CRC32s).
"""

from __future__ import annotations

import json
import logging
import os
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import hicache_core as hc
from hicache_core import IoOp, PoolName
from tests.reliability._util import (
    GEOMETRY,
    HAVE_FILE,
    HAVE_HF3FS,
    HAVE_MOONCAKE,
    backend_name,
    fill_pages,
    hex_hash,
    page_matches,
    report,
    store_options,
)

pytestmark = pytest.mark.timeout(180)


def _open(backend: str, root: Path, pages: int) -> hc.CacheController:
    cfg = hc.StorageConfig(
        backend=backend_name(backend),
        options=store_options(backend, root),
        model_name="corrupt",
        extensions=["metrics"],
    )
    return hc.CacheController(cfg, hc.HostPoolGroup(hc.MHAKVPool(pages, **GEOMETRY)))


def _metrics(ctl: hc.CacheController) -> Any:
    ext = ctl.store.extensions["metrics"]
    if ext._backend is None:  # type: ignore[attr-defined]  # until Store binds extensions itself
        ext.bind_store(ctl.store)  # type: ignore[attr-defined]
    return ext


def _corrupt_file(path: str, rng: random.Random) -> str:
    """Damage one page file in place; return what was done."""
    size = os.path.getsize(path)
    kind = rng.choice(["flip-payload", "flip-header", "truncate", "empty", "append", "swap"])
    with open(path, "r+b") as f:
        if kind.startswith("flip"):
            # fixed header: magic(4) version(1) algo(1) key length(2) payload length(8) checksum(8),
            # then the key. Flips of the payload-length field are the known bug below.
            header_offsets = [*range(0, 8), *range(16, 24)]
            off = rng.choice(header_offsets) if kind == "flip-header" else rng.randrange(24, size)
            f.seek(off)
            byte = f.read(1)[0]
            f.seek(off)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        elif kind == "truncate":
            f.truncate(rng.randrange(1, size))
        elif kind == "empty":
            f.truncate(0)
        elif kind == "append":
            f.seek(0, os.SEEK_END)
            f.write(os.urandom(rng.randrange(1, 64)))
        else:  # overwrite the payload with other bytes of the same length (stale / misplaced data)
            f.seek(size - 4096)
            f.write(os.urandom(4096))
    return kind


def _flip(f: Any, off: int, rng: random.Random) -> None:
    f.seek(off)
    byte = f.read(1)[0]
    f.seek(off)
    f.write(bytes([byte ^ (1 << rng.randrange(8))]))


def _corrupt_segment(backend: Any, key: str, other: str, rng: random.Random) -> str:
    """Damage the stored bytes of ``key`` inside its segment; return what was done.

    ``other`` is another stored key of the same length: ``swap`` copies its bytes over
    ``key``'s (misplaced data of the right length, which only the checksum can catch)."""
    seg, off, length, _digest, _t = backend.segments._map[key]
    path = os.path.join(backend.segments.root, "segments", seg)
    kind = rng.choice(["flip-payload", "zero-block", "swap"])
    with open(path, "r+b") as f:
        if kind == "flip-payload":
            _flip(f, off + rng.randrange(length), rng)
        elif kind == "zero-block":  # what a block that never reached the disk reads as
            f.seek(off + rng.randrange(length) // 4096 * 4096)
            f.write(bytes(4096))
        else:
            oseg, ooff, olen, _, _ = backend.segments._map[other]
            assert olen == length
            with open(os.path.join(backend.segments.root, "segments", oseg), "rb") as g:
                g.seek(ooff)
                data = g.read(length)
            f.seek(off)
            f.write(data)
    return kind


@pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed")
@pytest.mark.parametrize("backend", ["file", "file-segments"])
def test_file_corruption_is_detected_counted_logged(
    backend: str, tmp_path: Path, caplog, long_mode: bool, record_property
) -> None:
    """Damaged page bytes (page files; segment data) are misses, counted, logged, rewritten."""
    rng = random.Random(7)
    n = 256 if long_mode else 96
    hashes = [hex_hash("corrupt", i) for i in range(n)]
    root = tmp_path / "root"
    caplog.set_level(logging.WARNING, logger="hicache.file")
    with _open(backend, root, n) as ctl:
        pool = ctl.pools.anchor
        fill_pages(pool, range(n), hashes)
        assert ctl.backup(hashes, range(n)).pages == n
        keys = ctl.store.page_keys(PoolName.KV, hashes)
        be = ctl.store.backend
        victims = rng.sample(range(n), n // 3)
        kinds: dict[str, int] = {}
        for i in victims:
            comp = rng.randrange(2)
            if backend == "file":
                kind = _corrupt_file(be.path_of(keys[i][comp]), rng)
            else:
                j = rng.choice([j for j in range(n) if j != i])
                kind = _corrupt_segment(be, keys[i][comp], keys[j][comp], rng)
            kinds[kind] = kinds.get(kind, 0) + 1
        before = be.integrity_errors
        caplog.clear()
        for b in pool.buffers():
            b.fill_(0)
        flat = [k for ks in keys for k in ks]
        views = [v for page in pool.page_views(range(n)) for v in page]
        got = ctl.store.batch_io_v1(IoOp.GET, flat, views)
        page_ok = [all(got[2 * i : 2 * i + 2]) for i in range(n)]
        detected = sum(1 for i in victims if not page_ok[i])
        returned_bad = sum(1 for i in range(n) if page_ok[i] and not page_matches(pool, i, hashes[i]))
        counted = be.integrity_errors - before
        messages = [r.getMessage() for r in caplog.records]
        logged = sum(1 for m in messages if "corrupt page" in m or "checksum mismatch" in m)
        metric = _metrics(ctl).snapshot()["integrity_errors"]
        intact_ok = sum(1 for i in range(n) if i not in victims and page_ok[i])
        # self-healing: the damaged pages are forgotten (files: removed), so a backup rewrites them
        fill_pages(pool, range(n), hashes)
        writes_before = be.stats.writes
        again = ctl.backup(hashes, range(n))  # set skips the intact components itself
        rewritten = be.stats.writes - writes_before
        for b in pool.buffers():
            b.fill_(0)
        healed = ctl.prefetch(hashes, range(n)).pages
        healed_exact = sum(1 for i in range(healed) if page_matches(pool, i, hashes[i]))
    report(
        record_property,
        f"corruption-{backend}",
        pages=n,
        injected=len(victims),
        kinds=kinds,
        detected=detected,
        counted=counted,
        logged=logged,
        metric_integrity_errors=metric,
        returned_as_data=returned_bad,
        rewritten=rewritten,
        readable_after_rewrite=healed,
    )
    assert returned_bad == 0
    assert detected == len(victims)
    assert counted == len(victims) and metric == counted
    # files: one line per page; segments: one line per batch, naming the first damaged page
    assert logged == (len(victims) if backend == "file" else 1)
    assert intact_ok == n - len(victims)
    assert again.pages == n and rewritten == len(victims)  # one component per victim
    assert healed == n and healed_exact == n


REC_MAGIC = b"\xd5\x8e\xa7\xf1"  # hicache_file._seglog: where an index record starts


def _seg_store(tmp_path: Path, n: int, batch: int) -> tuple[Path, list[str]]:
    """A segment-layout root holding ``n`` pages (backed up ``batch`` at a time), and their hashes."""
    root = tmp_path / "root"
    hashes = [hex_hash("seg-index", i) for i in range(n)]
    with _open("file-segments", root, n) as ctl:
        pool = ctl.pools.anchor
        fill_pages(pool, range(n), hashes)
        for s in range(0, n, batch):
            assert ctl.backup(hashes[s : s + batch], range(s, s + batch)).pages == batch
    return root, hashes


def _read_back(root: Path, hashes: list[str]) -> tuple[list[bool], int]:
    """A fresh store (recovery from the logs): which pages it reports present, and how many of
    those read back other bytes than stored."""
    n = len(hashes)
    with _open("file-segments", root, n) as ctl:
        pool = ctl.pools.anchor
        keys = ctl.store.page_keys(PoolName.KV, hashes)
        flat = [k for ks in keys for k in ks]
        present = ctl.store.batch_io_v1(IoOp.EXISTS, flat)
        for b in pool.buffers():
            b.fill_(0)
        got = ctl.store.batch_io_v1(IoOp.GET, flat, [v for page in pool.page_views(range(n)) for v in page])
        page_present = [all(present[2 * i : 2 * i + 2]) for i in range(n)]
        page_ok = [all(got[2 * i : 2 * i + 2]) for i in range(n)]
        wrong = sum(1 for i in range(n) if page_ok[i] and not page_matches(pool, i, hashes[i]))
        unreadable = sum(1 for i in range(n) if page_present[i] and not page_ok[i])
    assert unreadable == 0, "a page reported present could not be read"
    return page_present, wrong


@pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed")
def test_segment_index_bit_flips_cost_only_their_pages(tmp_path: Path, record_property) -> None:
    """Bit flips in index records (and in the log header) of the segment layout: each damaged
    record loses its own page only (a miss), never returns wrong bytes; a backup heals."""
    rng = random.Random(13)
    n = 64
    root, hashes = _seg_store(tmp_path, n, 16)
    (log_path,) = (root / "index").glob("*.log")
    data = bytearray(log_path.read_bytes())
    starts = [i for i in range(len(data)) if data.startswith(REC_MAGIC, i)]
    assert len(starts) == n  # one record per page, in page order
    ends = [*starts[1:], len(data)]
    victims = sorted(rng.sample(range(n), n // 4))
    for v in victims:
        off = rng.randrange(starts[v], ends[v])
        data[off] ^= 1 << rng.randrange(8)
    data[rng.randrange(0, starts[0])] ^= 1 << rng.randrange(8)  # the header too
    log_path.write_bytes(bytes(data))
    present, wrong = _read_back(root, hashes)
    lost = [i for i in range(n) if not present[i]]
    with _open("file-segments", root, n) as ctl:
        pool = ctl.pools.anchor
        fill_pages(pool, range(n), hashes)
        assert ctl.backup(hashes, range(n)).pages == n
    healed, wrong_after = _read_back(root, hashes)
    report(
        record_property,
        "corruption-segment-index",
        pages=n,
        records_damaged=len(victims),
        pages_lost=len(lost),
        returned_as_data=wrong,
        present_after_rewrite=sum(healed),
    )
    assert wrong == 0 and wrong_after == 0
    assert lost == victims  # exactly the pages of the damaged records, not one more
    assert all(healed)


@pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed")
def test_segment_torn_index_tail_loses_only_unfinished_records(tmp_path: Path, record_property) -> None:
    """A log cut anywhere (a writer killed mid-append, power loss), with or without garbage after
    the cut: every page whose record is complete is present and exact, no other page is."""
    rng = random.Random(17)
    n = 32
    root, hashes = _seg_store(tmp_path, n, 8)
    (log_path,) = (root / "index").glob("*.log")
    full = log_path.read_bytes()
    starts = [i for i in range(len(full)) if full.startswith(REC_MAGIC, i)]
    ends = [*starts[1:], len(full)]
    cuts = sorted({rng.randrange(starts[0], len(full)) for _ in range(12)} | {starts[0], len(full) - 1})
    checked = 0
    for cut in cuts:
        for junk in (b"", os.urandom(rng.randrange(1, 200))):
            log_path.write_bytes(full[:cut] + junk)
            present, wrong = _read_back(root, hashes)
            complete = sum(1 for e in ends if e <= cut)
            assert wrong == 0, f"cut at {cut}: wrong bytes returned"
            assert present == [i < complete for i in range(n)], f"cut at {cut} (+{len(junk)} junk bytes)"
            checked += 1
    # a store kept open while the log grows record piece by record piece (a live writer's
    # unfinished tail) must read each record once it is complete, not give up on the tail
    log_path.write_bytes(full[: starts[0]])
    with _open("file-segments", root, n) as ctl:
        for cut in [*cuts, len(full)]:
            log_path.write_bytes(full[:cut])
            complete = sum(1 for e in ends if e <= cut)
            assert ctl.query(hashes).pages == complete, f"live reader, log grown to {cut} bytes"
            checked += 1
    assert all(_read_back(root, hashes)[0])
    report(record_property, "corruption-segment-torn-tail", cuts=checked, pages=n)


def _slots(data: bytes, key: bytes) -> int:
    pos = data.find(key)
    assert pos >= 0, f"key {key!r} not in the slot file"
    return pos - struct.calcsize("<4sBxHQQII")  # the header struct precedes the key


@pytest.mark.skipif(not HAVE_HF3FS, reason="hicache-hf3fs-stub not installed")
def test_hf3fs_bit_flips_are_misses(tmp_path: Path, record_property) -> None:
    rng = random.Random(11)
    n = 48
    hashes = [hex_hash("corrupt-hf3fs", i) for i in range(n)]
    with _open("hf3fs", tmp_path, n) as ctl:
        pool = ctl.pools.anchor
        fill_pages(pool, range(n), hashes)
        assert ctl.backup(hashes, range(n)).pages == n
        keys = ctl.store.page_keys(PoolName.KV, hashes)
        (data_file,) = [p for p in tmp_path.iterdir() if p.name.endswith(".bin")]
        victims = rng.sample(range(n), n // 3)
        blob = data_file.read_bytes()
        with open(data_file, "r+b") as f:
            for i in victims:
                start = _slots(blob, keys[i][rng.randrange(2)].encode())
                where = rng.choice(["header", "payload"])
                off = start + (
                    rng.randrange(0, 28)
                    if where == "header"
                    else 512 + rng.randrange(pool.component_nbytes[0])
                )
                f.seek(off)
                byte = f.read(1)[0]
                f.seek(off)
                f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        for b in pool.buffers():
            b.fill_(0)
        flat = [k for ks in keys for k in ks]
        views = [v for page in pool.page_views(range(n)) for v in page]
        got = ctl.store.batch_io_v1(IoOp.GET, flat, views)
        page_ok = [all(got[2 * i : 2 * i + 2]) for i in range(n)]
        detected = sum(1 for i in victims if not page_ok[i])
        returned_bad = sum(1 for i in range(n) if page_ok[i] and not page_matches(pool, i, hashes[i]))
        counted = _metrics(ctl).snapshot()["integrity_errors"]
    report(
        record_property,
        "corruption-hf3fs",
        injected=len(victims),
        detected=detected,
        returned_as_data=returned_bad,
        counted=counted,
    )
    assert returned_bad == 0 and detected == len(victims)


@pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed")
def test_file_length_field_flip_is_an_integrity_error(tmp_path: Path) -> None:
    hashes = [hex_hash("length-flip", i) for i in range(2)]
    with _open("file", tmp_path / "root", 2) as ctl:
        pool = ctl.pools.anchor
        fill_pages(pool, range(2), hashes)
        ctl.backup(hashes, range(2))
        backend = ctl.store.backend
        path = backend.path_of(ctl.store.page_keys(PoolName.KV, hashes[:1])[0][0])
        with open(path, "r+b") as f:
            f.seek(9)  # a bit of the payload-length field
            byte = f.read(1)[0]
            f.seek(9)
            f.write(bytes([byte ^ 0x04]))
        assert ctl.prefetch(hashes, range(2)).pages == 0  # a miss: this part already works
        assert backend.integrity_errors == 1  # counted (and logged, and removed) as corruption
        fill_pages(pool, range(2), hashes)
        ctl.backup(hashes, range(2))
        assert ctl.prefetch(hashes, range(2)).pages == 2  # rewritten by the next backup


@pytest.mark.mooncake
@pytest.mark.skipif(not HAVE_MOONCAKE, reason="hicache-mooncake not installed")
def test_mooncake_checksum_surfaces_corruption_per_page(record_property) -> None:
    """With MOONCAKE_STORE_CHECKSUM=1 (object CRC-64) a flipped byte is a per-page miss.

    Without it Mooncake returns the damaged bytes as data: the plugin has no checksum of its
    own, so it cannot detect corruption then (measured and reported, not asserted).
    """
    root = Path(__file__).resolve().parents[2]
    procs = {}
    for mode in ("1", "0"):
        env = dict(os.environ, MOONCAKE_STORE_CHECKSUM=mode, OMP_NUM_THREADS="1")
        procs[mode] = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability._mooncake_corrupt"],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    out = {}
    for mode, p in procs.items():
        text, _ = p.communicate(timeout=150)
        assert p.returncode == 0, f"child (checksum={mode}) failed with {p.returncode}"
        out[mode] = json.loads(text.strip().splitlines()[-1])
    on, off = out["1"], out["0"]
    report(record_property, "corruption-mooncake-checksum-on", **on)
    report(record_property, "corruption-mooncake-checksum-off", **off)
    assert on["returned_as_data"] == 0 and on["detected"] == on["injected"]
    assert on["intact_reported_ok"] == on["pages"] - on["injected"]


@pytest.mark.skipif(not HAVE_HF3FS, reason="hicache-hf3fs-stub not installed")
def test_hf3fs_corrupt_page_is_counted_and_rewritable(tmp_path: Path) -> None:
    hashes = [hex_hash("hf3fs-heal", i) for i in range(2)]
    with _open("hf3fs", tmp_path, 4) as ctl:
        pool = ctl.pools.anchor
        fill_pages(pool, range(2), hashes)
        ctl.backup(hashes, range(2))
        keys = ctl.store.page_keys(PoolName.KV, hashes)
        (data_file,) = [p for p in tmp_path.iterdir() if p.name.endswith(".bin")]
        off = _slots(data_file.read_bytes(), keys[0][0].encode()) + 512 + 10
        with open(data_file, "r+b") as f:
            f.seek(off)
            byte = f.read(1)[0]
            f.seek(off)
            f.write(bytes([byte ^ 1]))
        assert ctl.prefetch(hashes, range(2, 4)).pages == 0  # detected: this part already works
        assert ctl.query(hashes).pages == 0  # no longer reported restorable
        assert getattr(ctl.store.backend, "integrity_errors", None) == 1
        fill_pages(pool, range(2), hashes)
        ctl.backup(hashes, range(2))
        assert ctl.prefetch(hashes, range(2, 4)).pages == 2  # rewritten by the next backup
