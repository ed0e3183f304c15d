"""The hf3fs index log format (``_indexlog``): per-record checks, resync, torn tails, versions.

Damage anywhere in a record costs that record only; a damaged header is repaired; a torn last
record is dropped; a format-1 log is read and upgraded; a log of a later format is refused and
left alone. A reader that meets damage while tailing another writer's appends decides under
the writer lock, then skips it like a reopen would.
"""

from __future__ import annotations

import logging
import struct
import zlib
from pathlib import Path

import pytest
from hf3fs_util import pattern
from hicache_hf3fs_stub import _indexlog as ilog
from hicache_hf3fs_stub._slotfile import SlotFile

from hicache_core import BackendIOError

NB = 512
KEYS = [f"ns.kv.k.tp0of1.p{i:02d}" for i in range(7)]
VICTIM = 3


def _open(path: Path) -> SlotFile:
    return SlotFile(path, capacity=NB, num_slots=16)


def _get(sf: SlotFile, keys: list[str]) -> list[bytes | None]:
    got: dict[int, bytes] = {}
    flags = sf.get([(k, NB) for k in keys], lambda i, p: got.__setitem__(i, bytes(p)))
    return [got.get(i) if ok else None for i, ok in enumerate(flags)]


def _written(tmp_path: Path) -> tuple[Path, bytes]:
    """A slot file holding KEYS, one index record each; returns its path and pristine log."""
    path = tmp_path / "f.bin"
    sf = _open(path)
    for k in KEYS:
        assert sf.put([(k, memoryview(pattern(k, NB)))]) == [True]
    sf.close()
    return path, Path(f"{path}.idx").read_bytes()


def _span(log: bytes, key: str) -> range:
    """Byte offsets of ``key``'s PUT record in ``log``."""
    end = log.index(key.encode()) + len(key)
    return range(end - len(key) - ilog.REC_SIZE, end)


def _expect_all_but(sf: SlotFile, lost: set[int]) -> None:
    assert sf.exists(KEYS) == [i not in lost for i in range(len(KEYS))]
    assert _get(sf, KEYS) == [None if i in lost else pattern(k, NB) for i, k in enumerate(KEYS)]


def test_every_bit_of_a_middle_record_costs_that_record_only(tmp_path: Path) -> None:
    path, pristine = _written(tmp_path)
    idx = Path(f"{path}.idx")
    span = _span(pristine, KEYS[VICTIM])
    for at in span:
        for bit in (0x01, 0x80):
            raw = bytearray(pristine)
            raw[at] ^= bit
            idx.write_bytes(bytes(raw))
            sf = _open(path)
            assert sf.integrity_errors == 1, (at, bit)
            _expect_all_but(sf, {VICTIM})
            sf.close()
            again = _open(path)  # the writer rewrote the log without the damage
            assert again.integrity_errors == 0
            _expect_all_but(again, {VICTIM})
            again.close()


def test_damage_across_records_costs_only_the_records_it_covers(tmp_path: Path) -> None:
    path, pristine = _written(tmp_path)
    a, b = _span(pristine, KEYS[2]), _span(pristine, KEYS[4])
    raw = bytearray(pristine)
    raw[a.start + 5 : b.start + 3] = bytes(b.start + 3 - a.start - 5)  # zeroes over 2, 3 and 4's start
    Path(f"{path}.idx").write_bytes(bytes(raw))
    sf = _open(path)
    _expect_all_but(sf, {2, 3, 4})
    sf.close()


def test_damaged_or_torn_last_record_is_dropped_and_writes_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, pristine = _written(tmp_path)
    idx = Path(f"{path}.idx")
    last = _span(pristine, KEYS[-1])
    for damaged in (pristine[: last.start + 30], pristine[:-3] + b"\xff" + pristine[-2:]):
        idx.write_bytes(damaged)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hicache.hf3fs"):
            sf = _open(path)
        assert "torn index record" in caplog.text
        assert idx.stat().st_size == last.start  # truncated before the next append
        _expect_all_but(sf, {len(KEYS) - 1})
        assert sf.put([(KEYS[-1], memoryview(pattern(KEYS[-1], NB)))]) == [True]
        _expect_all_but(sf, set())
        sf.close()
        idx.write_bytes(pristine)


@pytest.mark.parametrize("at", [0, 7, 8, 20, 24, 27])  # magic, version digit, file id, header crc
def test_damaged_header_is_repaired_keeping_every_record(tmp_path: Path, at: int) -> None:
    path, pristine = _written(tmp_path)
    idx = Path(f"{path}.idx")
    raw = bytearray(pristine)
    raw[at] ^= 0x04
    idx.write_bytes(bytes(raw))
    sf = _open(path)
    assert sf.integrity_errors == 1
    _expect_all_but(sf, set())
    sf.close()
    assert idx.read_bytes()[: ilog.HEADER_SIZE] == pristine[: ilog.HEADER_SIZE]


def _file_id(path: Path) -> bytes:
    return path.read_bytes()[48:64]  # superblock: magic 16, version 4, header 4, 3 x 8, file id


def test_format_1_log_is_read_and_upgraded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, _ = _written(tmp_path)
    sf = _open(path)
    entries = sorted(sf._index.items(), key=lambda kv: kv[1][1])
    sf.close()
    v1 = b"H3FSIDX1" + _file_id(path)
    for key, (slot, seq) in entries:  # format 1: crc32 | kind | 0 | key length | slot | seq | key
        body = struct.pack("<BxHIQ", ilog.PUT, len(key), slot, seq) + key.encode()
        v1 += struct.pack("<I", zlib.crc32(body)) + body
    idx = Path(f"{path}.idx")
    idx.write_bytes(v1)
    with caplog.at_level(logging.INFO, logger="hicache.hf3fs"):
        sf = _open(path)
    assert "from index format 1 to 2" in caplog.text
    _expect_all_but(sf, set())
    sf.close()
    assert idx.read_bytes().startswith(b"H3FSIDX2" + _file_id(path))


def test_log_of_a_later_format_is_refused_and_left_alone(tmp_path: Path) -> None:
    path, _ = _written(tmp_path)
    body = b"H3FSIDX3" + _file_id(path) + b"records of a format this version does not know" * 3
    newer = body[:28] + struct.pack("<I", zlib.crc32(body[:28])) + body[28:]
    idx = Path(f"{path}.idx")
    idx.write_bytes(newer)
    with pytest.raises(BackendIOError, match="index log of format 3"):
        _open(path)
    assert idx.read_bytes() == newer


def test_log_of_another_data_file_starts_an_empty_index(tmp_path: Path) -> None:
    path, _ = _written(tmp_path)
    other, _ = _written(tmp_path / "other")
    Path(f"{path}.idx").write_bytes(Path(f"{other}.idx").read_bytes())
    sf = _open(path)
    assert sf.exists(KEYS) == [False] * len(KEYS) and sf.integrity_errors == 0
    sf.close()


def test_tailing_reader_skips_damage_under_the_writer_lock(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    writer, reader = _open(path), _open(path)
    head = KEYS[:2]
    assert writer.put([(k, memoryview(pattern(k, NB))) for k in head]) == [True, True]
    assert reader.exists(head) == [True, True]
    for k in KEYS[2:]:
        assert writer.put([(k, memoryview(pattern(k, NB)))]) == [True]
    idx = Path(f"{path}.idx")
    raw = bytearray(idx.read_bytes())
    raw[_span(bytes(raw), KEYS[VICTIM]).start + 9] ^= 0x01  # damaged before the reader tails it
    idx.write_bytes(bytes(raw))
    _expect_all_but(reader, {VICTIM})
    assert reader.integrity_errors == 1
    _expect_all_but(writer, {VICTIM})  # the reader rewrote the log: the writer reloads it
    assert writer.integrity_errors == 0
    writer.close()
    reader.close()


def test_replay_leaves_an_unfinished_tail_unconsumed() -> None:
    seed = ilog.seed(b"x" * 16)
    recs = [ilog.record(seed, ilog.PUT, i, i + 1, f"k{i}".encode()) for i in range(3)]
    blob = b"".join(recs)
    for cut in range(len(blob) - len(recs[-1]), len(blob)):
        got = ilog.replay(blob[:cut], seed)
        assert [r[3] for r in got.records] == ["k0", "k1"] and not got.damaged
        assert got.consumed == len(blob) - len(recs[-1])
    assert ilog.replay(blob, ilog.seed(b"y" * 16)).records == []  # another data file's records
