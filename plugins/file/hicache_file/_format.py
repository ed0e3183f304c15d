"""On-disk format of the file backend: page header, checksum and directory layout.

One file per component key::

    <root>/<namespace>/<key[-1:]>/<key>

``namespace`` is the key's first dot-separated field (``_`` for a key without a dot), so
``hicache_clear(namespace)`` touches one directory. The shard directory is the key's last
character (``_`` for a key ending in ``.``); core keys end with a sha256 hex page hash, so they spread evenly over 16 shard
directories per namespace, and the components of one page (K and V, every rank) share one.

Why 16 and not 4096 (the last three characters, format 1 and the first format-2 builds): a
fresh namespace creates a shard directory for almost every page it writes until all of them
exist, and a ``mkdir`` costs as much as writing a small page. Measured on this project's 2-core
VM (ext4), a 512-file backup of 16 KiB objects into a fresh store took 22-23 ms with 4096
shards against 17.5-20 ms with 16 or none, and 16.5-21 ms for a raw ``open``/``write`` loop
into one directory (2 I/O threads, fresh store each time). 16 directories still shard: at
16 M files per namespace each holds 1 M, within what ext4's hashed directories index without
``large_dir`` (about 6 M names of our ~115 characters per directory, so about 100 M files per
namespace) and far within XFS's.

Every file is a fixed 24-byte header, the key, zero padding, then the payload::

    offset  size  field
    0       4     magic  b"HCFP"
    4       1     format version (2)
    5       1     checksum algorithm (1 = xxh3_64 of the payload)
    6       2     key length, little-endian u16
    8       8     payload length, little-endian u64
    16      8     payload checksum, little-endian u64
    24      klen  the key (ASCII), so a misplaced or colliding file is detected
    24+klen pad   zero bytes up to the next multiple of 64 (``header_size``)
    h       n     payload (the page component bytes, layer-major), h = 64 * ceil((24+klen)/64)

The payload starts on a 64-byte boundary because the kernel copies between the page cache and
a (page-aligned) pool page with ``rep movsb``, which is much slower when source and
destination are not equally aligned within a cache line: reading 128 x 256 KiB pages took
20-30 % longer with the payload at offset 140 (format 1, no padding) than at 0, 128, 192 or
4096 (a C read that checksums each payload, paired, 24 rounds; 10 % longer at 16 KiB). The
padding costs at most 63 bytes per file; page alignment (4096) measured no faster and would
cost up to 4 KiB.

Files appear under their final name in one step (an ``O_TMPFILE`` inode linked to it, or a
``.tmp-*`` file renamed over it; see :mod:`hicache_file._publish`), so a reader never sees a
torn page. Names starting with ``.tmp-`` are never pages; keys never start with ``.`` (see
:func:`hicache_core.check_key`).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

import xxhash

__all__ = [
    "ALGO_XXH3_64",
    "FIXED_HEADER",
    "FORMAT_VERSION",
    "MAGIC",
    "MARKER_NAME",
    "PAYLOAD_ALIGN",
    "TEMP_PREFIX",
    "checksum",
    "encode_header",
    "header_parts",
    "header_size",
    "header_tail",
    "location",
    "relpath",
    "shard",
    "xxh3_64",
    "xxh3_stream",
]

MAGIC = b"HCFP"
FORMAT_VERSION = 2
PAYLOAD_ALIGN = 64
ALGO_XXH3_64 = 1
FIXED_HEADER = 24
TEMP_PREFIX = ".tmp-"
LAYOUT = "<namespace>/<key[-1:]>/<key>"
MARKER_NAME = ".hicache-file.json"
"""A small JSON file at the root recording the format version (written once)."""
TEMP_DIR = ".hicache-tmp"
"""The root's directory of in-flight temp files (``publish: "rename"`` only)."""

_FIXED = struct.Struct("<4sBBHQQ")  # magic, version, algo, key length, payload length, checksum
xxh3_64 = xxhash.xxh3_64_intdigest
xxh3_stream = xxhash.xxh3_64
"""A streaming xxh3_64 (``update`` then ``intdigest``): the same value as :data:`xxh3_64` of the
concatenation."""


def checksum(parts: Sequence[Any]) -> int:
    """xxh3_64 of the concatenation of ``parts`` (buffer objects), without joining them.

    Streaming over several parts (a ``layer_first`` page is one run per layer) gives the same
    value as hashing the joined bytes, so a page written from one layout verifies in the other.
    """
    if len(parts) == 1:
        return xxh3_64(parts[0])
    h = xxh3_stream()
    for p in parts:
        h.update(p)
    return h.intdigest()


def header_size(key_len: int) -> int:
    """Bytes before the payload for a key of ``key_len`` ASCII characters (a multiple of 64)."""
    return (FIXED_HEADER + key_len + PAYLOAD_ALIGN - 1) & -PAYLOAD_ALIGN


def header_tail(key: bytes) -> bytes:
    """What a valid header holds after its fixed 24 bytes: the key, then zero padding."""
    return key + bytes(header_size(len(key)) - FIXED_HEADER - len(key))


@functools.lru_cache(maxsize=256)
def header_parts(key_len: int, payload_len: int) -> tuple[bytes, bytes]:
    """``(fixed, pad)``: the fixed 24 header bytes with a zero checksum, and the zero padding.

    ``fixed + key + pad`` is ``encode_header(key, payload_len, 0)``, without packing it again:
    a batch repeats a few (key length, size) pairs thousands of times.
    """
    return _FIXED.pack(MAGIC, FORMAT_VERSION, ALGO_XXH3_64, key_len, payload_len, 0), bytes(
        header_size(key_len) - FIXED_HEADER - key_len
    )


def encode_header(key: bytes, payload_len: int, digest: int) -> bytes:
    """The full header (fixed part, key, padding) of a page."""
    return _FIXED.pack(MAGIC, FORMAT_VERSION, ALGO_XXH3_64, len(key), payload_len, digest) + header_tail(key)


def classify(
    header: bytes | bytearray, nread: int, key: bytes, payload_len: int, file_size: int
) -> str | None:
    """Why a read of ``nread`` bytes (header buffer ``header``) of a ``file_size``-byte file is
    not a valid page.

    Returns ``None`` when the header describes a *valid object of another size* (a miss, not
    corruption: the length field agrees with the file size); otherwise a short reason for the
    integrity log. Only called on the slow path.
    """
    hsize = header_size(len(key))
    if nread < FIXED_HEADER:
        return f"truncated header ({nread} bytes)"
    magic, version, algo, stored_klen, stored_len, _ = _FIXED.unpack_from(header, 0)
    if magic != MAGIC:
        return "bad magic (not a hicache page)"
    if version != FORMAT_VERSION or algo != ALGO_XXH3_64:
        return f"unknown format version {version} / checksum algorithm {algo}"
    if stored_klen != len(key) or nread < hsize or bytes(header[FIXED_HEADER:hsize]) != header_tail(key):
        return "header names another key (misplaced or colliding file)"
    if stored_len != payload_len:
        if file_size == hsize + stored_len:
            return None
        return f"payload length field says {stored_len} bytes but the file holds {file_size - hsize}"
    expected = hsize + payload_len
    if nread < expected:
        return f"truncated payload ({nread - hsize} of {payload_len} bytes)"
    if nread > expected:
        return "trailing data after the payload"
    return "checksum mismatch"


def relpath(key: str) -> str:
    """``<namespace>/<shard>/<key>`` for a key already checked by ``check_key``."""
    ns, sh = location(key)
    return f"{ns}/{sh}/{key}"


def location(key: str) -> tuple[str, str]:
    """``(namespace directory, shard directory)`` of a key already checked by ``check_key``."""
    dot = key.find(".")
    return (key[:dot] if dot > 0 else "_"), shard(key)


def shard(key: str) -> str:
    """The key's shard directory: its last character, ``_`` for a key ending in ``.``."""
    last = key[-1]
    return "_" if last == "." else last
