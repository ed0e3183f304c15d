"""The batched I/O path over the ``_fastio`` C extension (used when it is built).

Python decides everything: it builds each page's header and what a valid page's header must
be (``_format`` is the only definition of the format), hands a range of pages to one
``_fastio`` call, which issues the syscalls with the GIL released (so ``io_threads`` ranges
really overlap in the kernel), and accounts every result exactly like the pure-Python path in
``_backend``. When the extension found XXH3 in python-xxhash's extension module
(``_fastio.HAVE_XXH3``, checked against ``xxhash`` at import), :func:`_fastio.publish_batch_xxh3`
also checksums each payload right before writing it, and :func:`_fastio.read_verify_batch`
checks each page read against its expected header and checksum, all without the GIL:
python-xxhash holds the GIL, so two I/O threads would checksum one after the other, and the
per-page verification loop in Python cost ~3 us per page. Without it, ``publish_batch`` and
``read_batch`` move the bytes and Python checksums and verifies. Any read that does not verify
is handed back to the pure-Python path, which re-reads, classifies and quarantines it, so
corruption handling lives in one place.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _format as fmt
from ._stats import _Tally

if TYPE_CHECKING:
    from ._pool_io import Post
    from ._publish import Publisher

try:
    from . import _fastio  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler at install time): the pure-Python path is used
    _fastio = None

__all__ = ["available", "checksums_in_c", "get_range", "set_range"]

_FH = fmt.FIXED_HEADER
_ENOENT = -errno.ENOENT


def available() -> bool:
    """The extension is built and can publish with ``O_TMPFILE`` on this platform."""
    return _fastio is not None and bool(_fastio.HAVE_TMPFILE)


def _c_xxh3_agrees() -> bool:
    """The extension found python-xxhash's XXH3 and it gives ``_format``'s digests."""
    if _fastio is None or not getattr(_fastio, "HAVE_XXH3", 0):
        return False
    probe = bytes(range(256)) * 9
    return all(_fastio.xxh3_64(b) == fmt.xxh3_64(b) for b in (b"", probe[:7], probe[:240], probe))


_C_SUMS = _c_xxh3_agrees()


def checksums_in_c() -> bool:
    """Writes and reads checksum their payloads in C, without the GIL.

    True when the extension is built and resolved XXH3 from python-xxhash's own extension module
    (the implementation Python uses, with run-time SIMD dispatch), and it agrees with
    ``xxhash.xxh3_64_intdigest`` on probe buffers at import.
    """
    return _C_SUMS


def set_range(
    publisher: Publisher,
    max_bytes: int | None,
    track: bool,
    keys: Sequence[str],
    paths: list[str],
    iovs: list[list[Any]],
    sizes: list[int],
    absent: frozenset[str] | set[str],
    lo: int,
    hi: int,
) -> tuple[list[bool], _Tally]:
    """Publish pages ``lo..hi`` (``O_TMPFILE`` publishers without fsync); returns flags and tally.

    Same semantics as the pure-Python ``_set_range``: a present key is skipped and ``True``;
    a failed key is ``False`` with nothing left behind; a missing shard directory is created
    and the page retried (twice, as a racing ``clear`` may remove it again).
    """
    tally = _Tally()
    out = [False] * (hi - lo)
    header, parts, xxh3, checksum = fmt.encode_header, fmt.header_parts, fmt.xxh3_64, fmt.checksum
    in_c = checksums_in_c()  # C stores each digest in its (writable) header just before the write
    publish = _fastio.publish_batch_xxh3 if in_c else _fastio.publish_batch
    items: list[tuple[str, str, list[Any], bool]] = []
    where: list[int] = []  # position in ``out`` of each item
    disks: list[int] = []
    for j in range(lo, hi):
        key, path, iov, size = keys[j], paths[j], iovs[j], sizes[j]
        kb = key.encode("ascii")
        fixed, pad = parts(len(kb), size)
        disk = len(fixed) + len(kb) + len(pad) + size
        if max_bytes is not None and disk > max_bytes:
            tally.error("write_errors", OSError(errno.EFBIG, f"page exceeds max_bytes={max_bytes}"), path)
            continue
        if in_c:
            head: bytes | bytearray = bytearray(fixed + kb + pad)
        else:
            head = header(kb, size, xxh3(iov[0]) if len(iov) == 1 else checksum(iov))
        items.append((path[: len(path) - len(key)], path, [head, *iov], key not in absent))
        where.append(j - lo)
        disks.append(disk)
    codes = publish(items) if items else []
    for _attempt in range(2):
        retry = [i for i, c in enumerate(codes) if c == _ENOENT]
        if not retry:
            break
        for d in dict.fromkeys(items[i][0] for i in retry):
            try:
                publisher.makedirs(d)
            except OSError:
                pass  # the retry reports the error for each page
        for i, c in zip(retry, publish([items[i] for i in retry])):
            codes[i] = c
    writes = skipped = nbytes = 0
    for i, code in enumerate(codes):
        pos = where[i]
        if code < 0:
            tally.error("write_errors", OSError(-code, os.strerror(-code)), items[i][1])
            continue
        out[pos] = True
        key = keys[lo + pos]
        if code == 0:
            writes += 1
            nbytes += sizes[lo + pos]
        else:
            skipped += 1
        if track:
            tally.touched.append((key, disks[i]))
    tally.add("writes", writes)
    tally.add("skipped_writes", skipped)
    tally.add("bytes_written", nbytes)
    return out, tally


def get_range(
    slow: Callable[..., tuple[list[bool], _Tally]],
    track: bool,
    keys: Sequence[str],
    paths: list[str],
    iovs: list[list[Any]],
    sizes: list[int],
    posts: list[Post | None] | None,
    lo: int,
    hi: int,
) -> tuple[list[bool], _Tally]:
    """Read and verify pages ``lo..hi``; anything that does not verify goes to ``slow``.

    ``slow`` is the pure-Python reader (same arguments as this function after ``track``), called
    for that one page: it re-reads it, tells a valid page of another size (a plain miss) from
    corruption, and quarantines the latter.
    """
    tally = _Tally()
    expected: list[bytes] = []  # each page's header with a zero checksum (C skips that field)
    parts = fmt.header_parts
    for j in range(lo, hi):
        kb = keys[j].encode("ascii")
        fixed, pad = parts(len(kb), sizes[j])
        expected.append(fixed + kb + pad)
    if checksums_in_c():
        codes = (
            _fastio.read_verify_batch([(paths[j], e, iovs[j]) for j, e in zip(range(lo, hi), expected)])
            if expected
            else []
        )
    else:
        codes = _verify_in_python(paths, iovs, sizes, expected, lo, hi)
    out: list[bool] = []
    hits = misses = nbytes = 0
    for i, code in enumerate(codes):
        j = lo + i
        if code == 0:
            if posts is not None and posts[j] is not None:
                dst, scratch = posts[j]  # type: ignore[misc]
                dst.copy_(scratch.view(dst.shape))
            hits += 1
            nbytes += sizes[j]
            if track:
                tally.touched.append((keys[j], len(expected[i]) + sizes[j]))
            out.append(True)
        elif code == _ENOENT:
            misses += 1
            out.append(False)
        elif code < 0:
            tally.error("read_errors", OSError(-code, os.strerror(-code)), paths[j])
            out.append(False)
        else:  # not a valid page of this size: classify it the careful way
            flags, sub = slow(keys, paths, iovs, sizes, posts, j, j + 1)
            out += flags
            _merge(tally, sub)
    tally.add("hits", hits)
    tally.add("misses", misses)
    tally.add("bytes_read", nbytes)
    return out, tally


def _verify_in_python(
    paths: list[str], iovs: list[list[Any]], sizes: list[int], expected: list[bytes], lo: int, hi: int
) -> list[int]:
    """``read_verify_batch``'s result codes from ``read_batch`` plus checks in Python (no C XXH3)."""
    spare = bytearray(1)  # a byte read into it means trailing data
    headers = [bytearray(len(e)) for e in expected]
    items = [(paths[j], [h, *iovs[j], spare]) for j, h in zip(range(lo, hi), headers)]
    checksum, xxh3 = fmt.checksum, fmt.xxh3_64
    codes: list[int] = []
    for code, hdr, want, iov, size in zip(
        _fastio.read_batch(items) if items else [], headers, expected, iovs[lo:hi], sizes[lo:hi]
    ):
        if code < 0:
            codes.append(code)
        elif (
            code == len(hdr) + size
            and hdr[:16] == want[:16]
            and hdr[_FH:] == want[_FH:]
            and int.from_bytes(hdr[16:24], "little") == (xxh3(iov[0]) if len(iov) == 1 else checksum(iov))
        ):
            codes.append(0)
        else:
            codes.append(1)
    return codes


def _merge(into: _Tally, part: _Tally) -> None:
    for name, v in part.counts.items():
        into.add(name, v)
    into.errors += part.errors
    into.first_error = into.first_error or part.first_error
    into.touched += part.touched
    into.gone += part.gone
