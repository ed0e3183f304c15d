"""On-disk format of the hf3fs index log ``{file}.idx`` (format 2), and the reader of format 1.

Format 2::

    header   "H3FSIDX2" | file id (16 bytes) | crc32 of both           28 bytes
    record   magic | crc | kind | 0 | key length | slot | seq | key     24 + key length bytes

* ``magic`` (4 bytes, none of them can occur in a key) marks where a record starts;
* ``crc`` is the CRC32 of everything after it (fields and key), *seeded with the CRC32 of the
  data file's id*, so a record only verifies in the log of the data file it was written for;
* ``kind`` is ``PUT(key, slot, seq)`` or ``FREE(slot, seq)`` (no key).

Every record is checked on its own. Replay (:func:`replay`) applies each verified record; a
record that fails its check is skipped by resynchronising on the next record magic whose record
verifies, so damage in the middle of the log costs the records it covers (one flipped bit: one
record, one page) and nothing after it. Damage with no verified record after it is an unfinished
tail (a writer killed mid-append, or one still appending): it is left unconsumed, and the next
writer truncates it.

Format 1 (``"H3FSIDX1"``; records ``crc | kind | 0 | key length | slot | seq | key`` with an
unseeded CRC32 and no magic) is read for upgrades (:func:`replay_v1`, which stops at the first
bad record as format 1 always did); the backend then rewrites the log in format 2. A log of a
later format is refused, never guessed at.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["FREE", "HEADER_SIZE", "PUT", "REC_SIZE", "VERSION", "Header", "Replay", "classify"]

VERSION = 2
PUT, FREE = 1, 2
MAX_KEY = 255

_MAGIC = b"H3FSIDX"  # + the format version as one ASCII digit
_HEADER = struct.Struct("<8s16sI")  # magic + version, data file id, crc32 of the two
HEADER_SIZE = _HEADER.size
_REC_MAGIC = b"\xe5\x1d\x9a\xc3"
_REC = struct.Struct("<4sIBBHIQ")  # magic, crc, kind, reserved (0), key length, slot, seq
REC_SIZE = _REC.size
_CRC_AT = 8  # a record's crc covers its bytes from here on, key included

_V1_HEADER = struct.Struct("<8s16s")  # b"H3FSIDX1", data file id
_V1_REC = struct.Struct("<IBxHIQ")  # crc32 (of the rest), kind, key length, slot, seq


class Header(Enum):
    """What the first bytes of a log say about it (:func:`classify`)."""

    CURRENT = "current"  # format 2, for this data file
    V1 = "v1"  # format 1, for this data file: read it, then rewrite it in format 2
    DAMAGED = "damaged"  # format 2 for this data file, but the header itself is corrupt
    NEWER = "newer"  # a later format: refuse
    FOREIGN = "foreign"  # another data file's log, or no index log at all


Record = tuple[int, int, int, str]
"""``(kind, slot, seq, key)``; ``key`` is ``""`` for ``FREE``."""


@dataclass
class Replay:
    """The result of reading a run of records."""

    records: list[Record] = field(default_factory=list)
    consumed: int = 0
    """Bytes settled: verified records plus skipped damage. The rest is an unfinished tail."""
    damaged: list[tuple[int, int]] = field(default_factory=list)
    """``(offset, length)`` of each damaged run skipped (a verified record follows each)."""


def seed(file_id: bytes) -> int:
    """CRC32 seed of the records of the data file with id ``file_id``."""
    return zlib.crc32(file_id)


def header(file_id: bytes) -> bytes:
    """The format-2 header of the log of the data file with id ``file_id``."""
    body = _MAGIC + str(VERSION).encode() + file_id
    return body + struct.pack("<I", zlib.crc32(body))


def record(crc_seed: int, kind: int, slot: int, seq: int, key: bytes = b"") -> bytes:
    """One format-2 record."""
    tail = _REC.pack(_REC_MAGIC, 0, kind, 0, len(key), slot, seq)[_CRC_AT:] + key
    return _REC_MAGIC + struct.pack("<I", zlib.crc32(tail, crc_seed)) + tail


def _parse(data: bytes, pos: int, crc_seed: int) -> tuple[Record, int] | None:
    """The verified record at ``pos`` and where it ends, or ``None``."""
    if len(data) - pos < REC_SIZE or data[pos : pos + 4] != _REC_MAGIC:
        return None
    _, crc, kind, reserved, klen, slot, seq = _REC.unpack_from(data, pos)
    end = pos + REC_SIZE + klen
    if reserved or klen > MAX_KEY or end > len(data) or (kind == PUT) != (klen > 0):
        return None
    if kind not in (PUT, FREE) or zlib.crc32(data[pos + _CRC_AT : end], crc_seed) != crc:
        return None
    try:
        key = data[pos + REC_SIZE : end].decode("ascii")
    except UnicodeDecodeError:
        return None
    return (kind, slot, seq, key), end


def _resync(data: bytes, start: int, crc_seed: int) -> int:
    """Offset of the first verified record at or after ``start``, or -1."""
    pos = data.find(_REC_MAGIC, start)
    while pos >= 0:
        if _parse(data, pos, crc_seed) is not None:
            return pos
        pos = data.find(_REC_MAGIC, pos + 1)
    return -1


def replay(data: bytes, crc_seed: int) -> Replay:
    """Read the format-2 records in ``data``, skipping damaged runs (module docstring)."""
    out = Replay()
    pos = 0
    while pos < len(data):
        got = _parse(data, pos, crc_seed)
        if got is not None:
            out.records.append(got[0])
            pos = got[1]
            continue
        nxt = _resync(data, pos + 1, crc_seed)
        if nxt < 0:
            break  # an unfinished (torn or still being appended) tail
        out.damaged.append((pos, nxt - pos))
        pos = nxt
    out.consumed = pos
    return out


def replay_v1(data: bytes) -> Replay:
    """Read format-1 records, stopping at the first that fails its CRC (format 1's rule)."""
    out = Replay()
    pos = 0
    while pos + _V1_REC.size <= len(data):
        crc, kind, klen, slot, seq = _V1_REC.unpack_from(data, pos)
        end = pos + _V1_REC.size + klen
        if klen > MAX_KEY or end > len(data) or zlib.crc32(data[pos + 4 : end]) != crc:
            break
        try:
            key = data[pos + _V1_REC.size : end].decode("ascii")
        except UnicodeDecodeError:
            break
        if kind in (PUT, FREE):
            out.records.append((kind, slot, seq, key if kind == PUT else ""))
        pos = end
    out.consumed = pos
    return out


def v1_records_offset() -> int:
    """Where the records of a format-1 log start."""
    return _V1_HEADER.size


def classify(data: bytes, file_id: bytes) -> tuple[Header, int | None]:
    """What log ``data`` (the whole file) is, for the data file ``file_id``; and its version.

    A format-2 header that differs from the expected one in a few bits, or whose records verify
    under this data file's seed, is ours with a damaged header (its records are still read).
    """
    expected = header(file_id)
    head = data[:HEADER_SIZE]
    if head == expected:
        return Header.CURRENT, VERSION
    if data[: _V1_HEADER.size] == _V1_HEADER.pack(_MAGIC + b"1", file_id):
        return Header.V1, 1
    flipped = sum(bin(a ^ b).count("1") for a, b in zip(head, expected)) + 8 * (HEADER_SIZE - len(head))
    if flipped <= 4 or _resync(data, HEADER_SIZE, seed(file_id)) >= 0:
        return Header.DAMAGED, VERSION
    if head[:7] == _MAGIC and head[7:8].isdigit() and int(head[7:8]) > VERSION:
        return Header.NEWER, int(head[7:8])
    return Header.FOREIGN, None
