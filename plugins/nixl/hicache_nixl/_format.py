"""The object of the OBJ plugin: a 4 KiB header, then the page component's bytes (and helpers
shared with the POSIX side: ``digest``, ``aligned_empty``).

Header (little-endian): magic ``HCNIXL01`` (8 bytes), payload length (u64), xxh3_64 of the
payload (u64), key length (u16), the key (ASCII), then xxh3_64 of everything before it (u64);
zero-padded to :data:`HEADER` bytes so the payload starts 4 KiB-aligned (``O_DIRECT``). A read
is accepted only when the header verifies, names the key that was asked for, gives the expected
length, and the payload's checksum matches: a torn, truncated, foreign or bit-flipped object is
a miss, never wrong bytes.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:  # numpy is imported where used: `hicache backends` loads this module
    import numpy as np

__all__ = [
    "HEADER",
    "MAGIC",
    "OTHER_SIZE",
    "aligned_empty",
    "digest",
    "digests",
    "memory",
    "pack_header",
    "verify_header",
]

MAGIC = b"HCNIXL01"
HEADER = 4096
_FIXED = struct.Struct("<8sQQH")
_SUM = struct.Struct("<Q")
_EMPTY = xxhash.xxh3_64_intdigest(b"")


def aligned_empty(nbytes: int, align: int = HEADER) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` whose first byte is ``align``-aligned."""
    import numpy as np

    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes]


def memory(addr: int, nbytes: int) -> np.ndarray:
    """A uint8 array over ``nbytes`` of memory at ``addr`` (no copy; the caller keeps it alive)."""
    import numpy as np

    return np.frombuffer(memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B"), dtype=np.uint8)


def digest(segments: Sequence[tuple[int, int]]) -> int:
    """xxh3_64 of the concatenated memory ``segments`` (read in place, not copied)."""
    if len(segments) == 1:  # a page_first component: one call, no hasher object
        addr, n = segments[0]
        return xxhash.xxh3_64_intdigest((ctypes.c_ubyte * n).from_address(addr)) if n else _EMPTY
    h = xxhash.xxh3_64()
    for addr, n in segments:
        if n:
            h.update((ctypes.c_ubyte * n).from_address(addr))
    return h.intdigest()


def digests(items: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """``digest`` of each item's segments. ``xxhash`` releases the GIL while it hashes a buffer
    of 64 KiB or more, so a thread computing these runs beside NIXL's transfers."""
    return [digest(segs) for segs in items]


def pack_header(out: np.ndarray, key: str, length: int, payload_sum: int) -> None:
    """Write the header of ``key`` into ``out`` (at least :data:`HEADER` bytes, zeroed)."""
    import numpy as np

    kb = key.encode("ascii")
    body = _FIXED.pack(MAGIC, length, payload_sum, len(kb)) + kb
    body += _SUM.pack(xxhash.xxh3_64_intdigest(body))
    out[: len(body)] = np.frombuffer(body, dtype=np.uint8)


OTHER_SIZE = -1  # verify_header: a sound header of this key for a payload of another length


def verify_header(buf: np.ndarray, key: str, length: int) -> int | None:
    """The payload checksum the header in ``buf`` records for ``key``; :data:`OTHER_SIZE` when it is
    a sound header of ``key`` for another payload length; ``None`` when it does not verify."""
    raw = buf[:HEADER].tobytes()
    magic, n, payload_sum, klen = _FIXED.unpack_from(raw)
    end = _FIXED.size + klen
    if magic != MAGIC or end + _SUM.size > HEADER:
        return None
    (recorded,) = _SUM.unpack_from(raw, end)
    if recorded != xxhash.xxh3_64_intdigest(raw[:end]) or raw[_FIXED.size : end] != key.encode("ascii"):
        return None
    return int(payload_sum) if n == length else OTHER_SIZE
