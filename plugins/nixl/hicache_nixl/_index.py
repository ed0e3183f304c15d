"""The index log of the POSIX segment layout: ``root/index.log``, shared by every store of a root.

A record says where the objects of one batch lie, and it is appended (one ``O_APPEND`` write)
only after NIXL reported that batch's segment written, so an object is visible once whole.
Every record starts on a multiple of :data:`BLOCK` and is zero-padded to one::

    magic b"HCNXIDX1" | length u32 | kind u16 | name length u16 | entries u32 | body length u32 |
    xxh3_64 of the 24 bytes before it and of the body (u64)                       32 bytes
    body: name (the segment, or the namespace of a CLEAR), then per entry:
          key length u16 | offset u64 | length u64 | xxh3_64 of the object u64 | key

* ``PUT``: the entries are objects of segment ``name`` (``offset``: where in the file);
* ``DROP``: entries of segment ``name`` found damaged on a read (a key is dropped only while it
  still points there);
* ``CLEAR``: every key of namespace ``name`` stored before this record is removed.

Appends are atomic in their position (``O_APPEND`` under the inode lock); a short append (a
full disk) or a writer killed mid-append leaves a torn record, after which records no longer
start on a multiple of :data:`BLOCK`. So a record verifies only with its padding all zeros, and
:func:`parse` resynchronises on the next verified record at any byte offset. Damage with no verified record after it is an unfinished tail (still
being written, or of a killed writer): it is left unconsumed and read again once the log grows.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import xxhash

__all__ = ["BLOCK", "CLEAR", "DROP", "PUT", "Entry", "Record", "pack", "parse"]

MAGIC = b"HCNXIDX1"
BLOCK = 4096
PUT, DROP, CLEAR = 1, 2, 3
_HEAD = struct.Struct("<8sIHHII")  # 24 bytes, then the u64 checksum
_SUM = struct.Struct("<Q")
_ENTRY = struct.Struct("<HQQQ")
_FIXED = _HEAD.size + _SUM.size


class Entry(NamedTuple):
    key: str
    offset: int
    length: int
    digest: int


class Record(NamedTuple):
    kind: int
    name: str
    entries: list[Entry]


def pack(kind: int, name: str, entries: Sequence[Entry] = ()) -> bytes:
    """One record, padded to a multiple of :data:`BLOCK`."""
    nb = name.encode("ascii")
    parts = [nb]
    for e in entries:
        kb = e.key.encode("ascii")
        parts.append(_ENTRY.pack(len(kb), e.offset, e.length, e.digest))
        parts.append(kb)
    body = b"".join(parts)
    length = -(-(_FIXED + len(body)) // BLOCK) * BLOCK
    head = _HEAD.pack(MAGIC, length, kind, len(nb), len(entries), len(body))
    h = xxhash.xxh3_64(head)
    h.update(body)
    return b"".join((head, _SUM.pack(h.intdigest()), body, bytes(length - _FIXED - len(body))))


def _record_at(data: bytes | memoryview, p: int) -> tuple[int, Record] | None:
    """The verified record at ``p`` and its length, ``None`` when none verifies there."""
    if len(data) - p < _FIXED or data[p : p + 8] != MAGIC:
        return None
    _, length, kind, nlen, count, blen = _HEAD.unpack_from(data, p)
    if length % BLOCK or length < _FIXED + blen or p + length > len(data) or nlen > blen:
        return None
    body = bytes(data[p + _FIXED : p + _FIXED + blen])
    h = xxhash.xxh3_64(bytes(data[p : p + _HEAD.size]))
    h.update(body)
    if _SUM.unpack_from(data, p + _HEAD.size)[0] != h.intdigest():
        return None
    pad = bytes(data[p + _FIXED + blen : p + length])
    if pad.count(0) != len(pad):  # a torn record whose padding now holds the next record's bytes
        return None
    try:
        name = body[:nlen].decode("ascii")
        entries = []
        q = nlen
        for _ in range(count):
            klen, off, n, digest = _ENTRY.unpack_from(body, q)
            q += _ENTRY.size
            entries.append(Entry(body[q : q + klen].decode("ascii"), off, n, digest))
            q += klen
    except (struct.error, UnicodeDecodeError):
        return None
    return length, Record(kind, name, entries)


def parse(data: bytes) -> tuple[int, int, Iterator[Record]]:
    """``(consumed, skipped, records)`` of the log bytes ``data`` (read from a record boundary):
    ``consumed`` bytes are settled (verified records and damage followed by one), ``skipped`` of
    them were damage; what is past ``consumed`` is an unfinished tail."""
    out: list[Record] = []
    p = skipped = 0
    view = memoryview(data)
    while p < len(data):
        got = _record_at(view, p)
        if got is not None:
            out.append(got[1])
            p += got[0]
            continue
        # Resynchronise on the next verified record at any byte offset: after a torn append
        # (a short write under ENOSPC, a killed writer) later records no longer start on a
        # multiple of BLOCK.
        q = data.find(MAGIC, p + 1)
        while q >= 0 and _record_at(view, q) is None:
            q = data.find(MAGIC, q + 1)
        if q < 0:
            break  # no verified record after it: an unfinished tail
        skipped += q - p
        p = q
    return p, skipped, iter(out)
