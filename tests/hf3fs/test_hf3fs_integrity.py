"""hf3fs integrity: a corrupt slot is released, counted and logged; races and size mismatches are not.

A slot that fails its header or payload CRC check (confirmed under the writer lock) must leave
the index (exists False, the next set rewrites it), grow ``integrity_errors`` and log a WARNING
naming the key. A read that raced a concurrent overwrite, a stale index entry and a request of
another size are plain misses: nothing is released or counted.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hf3fs_util import config, pattern
from hicache_hf3fs_stub import _slotfile
from hicache_hf3fs_stub._slotfile import HEADER_SIZE, SlotFile

from hicache_core import IoOp, open_store

NB = 4096


def _slotfile_at(path: Path) -> SlotFile:
    return SlotFile(path, capacity=NB, num_slots=8)


def _put(sf: SlotFile, *keys: str) -> None:
    assert sf.put([(k, memoryview(pattern(k, NB))) for k in keys]) == [True] * len(keys)


def _get(sf: SlotFile, keys: list[str], nbytes: int = NB) -> list[bytes | None]:
    got: dict[int, bytes] = {}
    flags = sf.get([(k, nbytes) for k in keys], lambda i, p: got.__setitem__(i, bytes(p)))
    return [got.get(i) if ok else None for i, ok in enumerate(flags)]


def _flip(sf: SlotFile, key: str, offset: int) -> None:
    slot = sf.slot_of(key)
    assert slot is not None
    off = sf.slot_offset(slot) + offset
    with open(sf.path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)[0]
        f.seek(off)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("where", [HEADER_SIZE + 777, 0, 5, 14, 20])  # payload, magic, pad, length, seq
def test_corrupt_slot_is_released_counted_logged_and_rewritable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: int
) -> None:
    sf = _slotfile_at(tmp_path / "f.bin")
    _put(sf, "k.a", "k.b")
    _flip(sf, "k.a", where)
    caplog.set_level(logging.WARNING, logger="hicache.hf3fs")
    assert sf.exists(["k.a", "k.b"]) == [True, True]  # exists reads only the index
    assert _get(sf, ["k.a", "k.b"]) == [None, pattern("k.b", NB)]
    assert sf.integrity_errors == 1
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "'k.a'" in caplog.text and "corrupt page" in caplog.text
    assert sf.exists(["k.a", "k.b"]) == [False, True]  # released: no longer reported
    assert _get(sf, ["k.a"]) == [None] and sf.integrity_errors == 1  # a miss now, counted once
    _put(sf, "k.a")  # rewritten, not skipped as existing
    assert _get(sf, ["k.a", "k.b"]) == [pattern("k.a", NB), pattern("k.b", NB)]
    sf.close()
    # the FREE record is in the log: a fresh reader does not see the corrupt entry either
    other = _slotfile_at(tmp_path / "f.bin")
    assert _get(other, ["k.a", "k.b"]) == [pattern("k.a", NB), pattern("k.b", NB)]
    assert other.integrity_errors == 0
    other.close()


def test_another_process_sees_the_release(tmp_path: Path) -> None:
    a, b = _slotfile_at(tmp_path / "f.bin"), _slotfile_at(tmp_path / "f.bin")
    _put(a, "k.a")
    assert b.exists(["k.a"]) == [True]
    _flip(a, "k.a", HEADER_SIZE + 1)
    assert _get(a, ["k.a"]) == [None] and a.integrity_errors == 1
    assert b.exists(["k.a"]) == [False]  # b tails the FREE record
    assert _get(b, ["k.a"]) == [None] and b.integrity_errors == 0  # nothing left to count
    a.close()
    b.close()


def test_size_mismatch_is_a_plain_miss(tmp_path: Path) -> None:
    sf = _slotfile_at(tmp_path / "f.bin")
    _put(sf, "k.a")
    assert _get(sf, ["k.a"], nbytes=NB // 2) == [None]
    assert sf.integrity_errors == 0 and sf.exists(["k.a"]) == [True]
    assert _get(sf, ["k.a"]) == [pattern("k.a", NB)]
    sf.close()


def test_stale_index_after_another_writer_reused_the_slot_is_not_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other writer frees and reuses the slot between this reader's tail and its read."""
    a, b = _slotfile_at(tmp_path / "f.bin"), _slotfile_at(tmp_path / "f.bin")
    _put(a, "k.a")
    slot = a.slot_of("k.a")
    real_tail = a._tail
    calls = 0

    def racing_tail(repair: bool = False) -> None:
        nonlocal calls
        real_tail(repair)
        calls += 1
        if calls == 1:  # after get's tail: b releases k.a and writes k.z into the same slot
            assert b.remove(lambda k: k == "k.a") == 1
            _put(b, "k.z")
            assert b.slot_of("k.z") == slot

    monkeypatch.setattr(a, "_tail", racing_tail)
    assert _get(a, ["k.a"]) == [None]  # the header names k.z: suspect, then the log says freed
    assert a.integrity_errors == 0 and b.integrity_errors == 0
    monkeypatch.undo()
    assert a.exists(["k.a", "k.z"]) == [False, True]
    assert _get(a, ["k.z"]) == [pattern("k.z", NB)]
    a.close()
    b.close()


class _RacingOs:
    """Stands in for ``os`` in ``_slotfile``: tampers with the reader's first full-slot read."""

    def __init__(self, on_read: Any) -> None:
        self.on_read = on_read
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def preadv(self, fd: int, buffers: list[Any], offset: int) -> int:
        n = os.preadv(fd, buffers, offset)
        if not self.fired and len(buffers[0]) > HEADER_SIZE:
            self.fired = True
            self.on_read(buffers[0])
        return n


def test_torn_read_during_a_concurrent_overwrite_is_not_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Payload read torn AND the header changed before the re-check: a concurrent overwrite."""
    a, b = _slotfile_at(tmp_path / "f.bin"), _slotfile_at(tmp_path / "f.bin")
    _put(a, "k.a")

    def overwrite(buf: Any) -> None:
        buf[HEADER_SIZE + 3] ^= 0xFF  # the payload we got is half old, half new
        assert b.remove(lambda k: k == "k.a") == 1
        _put(b, "k.z")  # reuses the slot: its header changes before the reader re-checks it

    monkeypatch.setattr(_slotfile, "os", _RacingOs(overwrite))
    assert _get(a, ["k.a"]) == [None]
    monkeypatch.undo()
    assert a.integrity_errors == 0
    assert a.exists(["k.a", "k.z"]) == [False, True]
    a.close()
    b.close()


def test_transient_bad_read_is_re_read_and_delivered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed CRC that does not reproduce under the writer lock is not corruption."""
    sf = _slotfile_at(tmp_path / "f.bin")
    _put(sf, "k.a")

    def glitch(buf: Any) -> None:
        buf[HEADER_SIZE + 9] ^= 0x01

    monkeypatch.setattr(_slotfile, "os", _RacingOs(glitch))
    assert _get(sf, ["k.a"]) == [pattern("k.a", NB)]
    monkeypatch.undo()
    assert sf.integrity_errors == 0 and sf.exists(["k.a"]) == [True]
    sf.close()


def test_backend_exposes_integrity_errors(tmp_path: Path) -> None:
    store = open_store(config(tmp_path / "h", options={"bytes_per_page": NB}))
    backend = store.backend
    assert backend.integrity_errors == 0
    bufs = [torch.frombuffer(bytearray(pattern(k, NB)), dtype=torch.uint8) for k in ("k.a", "k.b")]
    assert store.batch_io_v1(IoOp.SET, ["k.a", "k.b"], bufs) == [True, True]
    sf = backend._files["0"]
    _flip(sf, "k.a", HEADER_SIZE)
    _flip(sf, "k.b", 20)
    out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(2)]
    assert store.batch_io_v1(IoOp.GET, ["k.a", "k.b"], out) == [False, False]
    assert isinstance(backend.integrity_errors, int) and backend.integrity_errors == 2
    assert store.batch_io_v1(IoOp.EXISTS, ["k.a", "k.b"]) == [False, False]
    assert store.batch_io_v1(IoOp.SET, ["k.a", "k.b"], bufs) == [True, True]
    assert store.batch_io_v1(IoOp.GET, ["k.a", "k.b"], out) == [True, True]
    assert [o.numpy().tobytes() for o in out] == [pattern("k.a", NB), pattern("k.b", NB)]
    store.close()
    assert backend.integrity_errors == 2  # still reported after close
