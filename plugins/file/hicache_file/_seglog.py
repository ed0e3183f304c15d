"""On-disk format of the segment layout: names, the per-writer index log and its records.

Layout (``layout: "segments"``)::

    <root>/.hicache-file.json            {"format": 2, "layout": "segments", ...}
    <root>/segments/<writer>-<n>.seg      page data, appended by one writer, never reused
    <root>/index/<writer>.log             that writer's append-only index log

``<writer>`` is ``<host>-<pid>-<token>`` (host: 8 hex digits naming this boot and PID
namespace; token: 8 random hex digits per opened store), so two writers never share a file
and a segment name is never reused: a stale index entry can only point at a missing file,
never at other bytes.

A log is a 44-byte header then records, each checked on its own::

    header   b"HCSEGLG1" | writer id, NUL-padded to 32 bytes | crc32 of both
    record   magic | crc | kind | entries | 0 | segment n | time_ns | offset    32 bytes
             then per entry: key length (u16) | length (u64) | xxh3_64 (u64) | key

* ``magic`` (4 bytes that never occur in a key) marks where a record starts;
* ``crc`` is the CRC32 of everything after it, *seeded with the CRC32 of the writer id*, so a
  record only verifies in the log of the writer whose segments it names;
* ``PUT`` (one record per page: every component of every pool of the page) says that its
  entries lie back to back from ``offset`` in segment ``<writer>-<n>.seg``, each starting on a
  multiple of :data:`ALIGN` (``O_DIRECT`` needs it); ``CLEAR`` (one entry, the key is the
  prefix) removes every key with that prefix stored before ``time_ns``.

The header is checked but not relied on: a record verifies against the writer id of the log's
*name*, so the records of a log with a damaged header are still read (one warning).

Replay (:func:`replay`) applies each verified record. A record that fails its check is skipped
by resynchronising on the next record magic whose record verifies, so a flipped bit costs one
record (one page). Damage with no verified record after it is an unfinished tail (a writer
killed mid-append, or one still appending): it is left unconsumed and read again once the log
grows.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass, field

__all__ = [
    "ALIGN",
    "CLEAR",
    "HEADER_SIZE",
    "INDEX_DIR",
    "LOG_SUFFIX",
    "PUT",
    "SEG_DIR",
    "SEG_SUFFIX",
    "Entry",
    "Record",
    "align",
    "clear_record",
    "header",
    "parse_log_name",
    "put_record",
    "replay",
    "seed",
    "seg_name",
]

ALIGN = 4096
SEG_DIR = "segments"
INDEX_DIR = "index"
SEG_SUFFIX = ".seg"
LOG_SUFFIX = ".log"
PUT, CLEAR = 1, 2
MAX_KEY = 255

_HEADER = struct.Struct("<8s32sI")
HEADER_SIZE = _HEADER.size
_LOG_MAGIC = b"HCSEGLG1"
_REC_MAGIC = b"\xd5\x8e\xa7\xf1"
_REC = struct.Struct("<4sIBBHIQQ")  # magic, crc, kind, entries, reserved, segment n, time_ns, offset
_ENT = struct.Struct("<HQQ")  # key length, length, xxh3_64
_CRC_AT = 8
_WRITER_RE = re.compile(r"[0-9a-fx]{1,8}-[0-9]{1,10}-[0-9a-f]{8}")

Entry = tuple[str, int, int]
"""``(key, length, xxh3_64)`` of one page component."""


@dataclass
class Record:
    kind: int
    seg: int
    time_ns: int
    offset: int
    entries: list[Entry]


@dataclass
class Replay:
    records: list[Record] = field(default_factory=list)
    consumed: int = 0
    """Bytes settled (verified records and skipped damage); the rest is an unfinished tail."""
    damaged: int = 0
    """Damaged runs skipped (each followed by a verified record)."""


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) & -ALIGN


def seg_name(writer: str, n: int) -> str:
    return f"{writer}-{n:06d}{SEG_SUFFIX}"


def parse_log_name(name: str) -> str | None:
    """The writer id of index log ``name``, or ``None`` when it is not one of ours."""
    if not name.endswith(LOG_SUFFIX):
        return None
    writer = name[: -len(LOG_SUFFIX)]
    return writer if _WRITER_RE.fullmatch(writer) else None


def seed(writer: str) -> int:
    return zlib.crc32(writer.encode("ascii"))


def header(writer: str) -> bytes:
    body = _LOG_MAGIC + writer.encode("ascii").ljust(32, b"\0")
    return body + struct.pack("<I", zlib.crc32(body))


def _pack(crc_seed: int, kind: int, seg: int, time_ns: int, offset: int, entries: list[Entry]) -> bytes:
    parts = [_REC.pack(_REC_MAGIC, 0, kind, len(entries), 0, seg, time_ns, offset)[_CRC_AT:]]
    for key, length, digest in entries:
        k = key.encode("ascii")
        parts.append(_ENT.pack(len(k), length, digest))
        parts.append(k)
    tail = b"".join(parts)
    return _REC_MAGIC + struct.pack("<I", zlib.crc32(tail, crc_seed)) + tail


def put_record(crc_seed: int, seg: int, time_ns: int, offset: int, entries: list[Entry]) -> bytes:
    """A ``PUT``: ``entries`` lie back to back (each padded to :data:`ALIGN`) from ``offset``."""
    return _pack(crc_seed, PUT, seg, time_ns, offset, entries)


def clear_record(crc_seed: int, time_ns: int, prefix: str) -> bytes:
    """A ``CLEAR``: keys starting with ``prefix`` stored before ``time_ns`` are gone."""
    return _pack(crc_seed, CLEAR, 0, time_ns, 0, [(prefix, 0, 0)])


def _parse(data: bytes, pos: int, crc_seed: int) -> tuple[Record, int] | None:
    """The verified record at ``pos`` and where it ends, or ``None``."""
    if len(data) - pos < _REC.size or data[pos : pos + 4] != _REC_MAGIC:
        return None
    _, crc, kind, count, reserved, seg, time_ns, offset = _REC.unpack_from(data, pos)
    if reserved or kind not in (PUT, CLEAR) or count == 0 or (kind == CLEAR and count != 1):
        return None
    end = pos + _REC.size
    spans = []
    for _ in range(count):
        if end + _ENT.size > len(data):
            return None
        klen, length, digest = _ENT.unpack_from(data, end)
        if not 0 < klen <= MAX_KEY or end + _ENT.size + klen > len(data):
            return None
        spans.append((end + _ENT.size, klen, length, digest))
        end += _ENT.size + klen
    if zlib.crc32(data[pos + _CRC_AT : end], crc_seed) != crc:
        return None
    try:
        entries = [(data[s : s + k].decode("ascii"), length, d) for s, k, length, d in spans]
    except UnicodeDecodeError:
        return None
    return Record(kind, seg, time_ns, offset, entries), end


def replay(data: bytes, crc_seed: int) -> Replay:
    """Read the records in ``data`` (a log's bytes after what was consumed before)."""
    out = Replay()
    pos = 0
    n = len(data)
    while pos < n:
        got = _parse(data, pos, crc_seed)
        if got is not None:
            out.records.append(got[0])
            pos = got[1]
            continue
        nxt = data.find(_REC_MAGIC, pos + 1)
        while nxt >= 0 and _parse(data, nxt, crc_seed) is None:
            nxt = data.find(_REC_MAGIC, nxt + 1)
        if nxt < 0:
            break  # an unfinished (torn, or still being appended) tail
        out.damaged += 1
        pos = nxt
    out.consumed = pos
    return out
