"""The batched I/O path over the ``_fastio`` C extension (used when it is built).

Python decides everything: it builds the batch's items (paths and page buffers), hands the
whole batch to one ``_fastio`` call, which issues the syscalls with the GIL released on
``io_threads`` threads of its own (each takes the next unclaimed page), and accounts every
result exactly like the pure-Python path in ``_backend``. ``_format`` defines the page format;
the C calls that build headers are checked against it at import. Building every item first and then letting C threads move them matters
for small pages: Python threads preparing their own ranges would take turns on the GIL, and
its switch interval (5 ms) is as long as a whole batch of 16 KiB pages.

When the extension found XXH3 in python-xxhash's extension module (``_fastio.HAVE_XXH3``,
checked against ``xxhash`` at import), :func:`_fastio.publish_pages_xxh3` builds each page's
header from its path (which ends with the key) and checksums the payload right before writing
it, and :func:`_fastio.read_verify_pages` checks each page read against the header it must
have and its checksum, all without the GIL: python-xxhash holds the GIL, so I/O threads would
checksum one after the other, and building headers and verifying pages in Python cost ~3 us
per page. Without it, Python builds the headers and checksums, ``publish_batch`` and
``read_batch`` move the bytes, and Python verifies. Any read that does not verify is handed back to the
pure-Python path, which re-reads, classifies and quarantines it, so corruption handling lives
in one place.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from itertools import repeat
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

__all__ = ["available", "checksums_in_c", "exists", "get_range", "set_range"]

_FH = fmt.FIXED_HEADER
_ENOENT = -errno.ENOENT


def available() -> bool:
    """The extension is built and can publish with ``O_TMPFILE`` on this platform."""
    return _fastio is not None and bool(_fastio.HAVE_TMPFILE)


def _c_pages_agree() -> bool:
    """The extension found python-xxhash's XXH3, it gives ``_format``'s digests, and the page
    headers it builds are ``_format``'s."""
    if _fastio is None or not getattr(_fastio, "HAVE_XXH3", 0):
        return False
    probe = bytes(range(256)) * 9
    if any(_fastio.xxh3_64(b) != fmt.xxh3_64(b) for b in (b"", probe[:7], probe[:240], probe)):
        return False
    keys = (b"k", b"ns.kv.k.tp0of1." + b"a" * 64, b"x" * 39, b"x" * 40, b"x" * 255)
    return all(
        _fastio.page_header(k, n) == fmt.encode_header(k, n, 0)
        for k in keys
        for n in (0, 1, 16384, 2**40 + 3)
    )


_C_SUMS = _c_pages_agree()


def checksums_in_c() -> bool:
    """Writes and reads checksum their payloads in C, without the GIL.

    True when the extension is built and resolved XXH3 from python-xxhash's own extension module
    (the implementation Python uses, with run-time SIMD dispatch), it agrees with
    ``xxhash.xxh3_64_intdigest`` on probe buffers at import, and the page headers it builds are
    ``_format``'s (checked at import too).
    """
    return _C_SUMS


def set_range(
    publisher: Publisher,
    max_bytes: int | None,
    track: bool,
    threads: int,
    keys: Sequence[str],
    paths: list[str],
    iovs: list[list[Any]],
    sizes: list[int],
    absent: frozenset[str] | set[str],
) -> tuple[list[bool], _Tally]:
    """Publish a whole batch (``O_TMPFILE`` publishers without fsync) on ``threads`` threads.

    Same semantics as the pure-Python ``_set_range``: a present key is skipped and ``True``;
    a failed key is ``False`` with nothing left behind; a missing shard directory is created
    and the page retried (twice, as a racing ``clear`` may remove it again).
    """
    tally = _Tally()
    n = len(keys)
    out = [False] * n
    in_c = checksums_in_c()  # C builds each header, and checksums the payload, just before the write
    publish = _fastio.publish_pages_xxh3 if in_c else _fastio.publish_batch
    # a key the caller's exists() found absent needs no second look; usually that is all of them
    check: Any = repeat(True) if not absent else repeat(False) if absent.issuperset(keys) else None
    if check is None:
        check = [k not in absent for k in keys]
    items: list[tuple[Any, ...]]
    where: list[int] | None = None  # position in ``out`` of each item, when some are left out
    if max_bytes is not None:
        where = []
        for j, (key, size) in enumerate(zip(keys, sizes)):
            if fmt.header_size(len(key)) + size > max_bytes:
                err = OSError(errno.EFBIG, f"page exceeds max_bytes={max_bytes}")
                tally.error("write_errors", err, paths[j])
            else:
                where.append(j)
    if in_c:  # each path ends with "/<key>": C takes the shard dir and the header's key from it
        items = list(zip(paths, iovs, check))
    else:
        header, xxh3, checksum = fmt.encode_header, fmt.xxh3_64, fmt.checksum
        items = [
            (
                path[: len(path) - len(key)],
                path,
                [header(key.encode(), size, xxh3(iov[0]) if len(iov) == 1 else checksum(iov)), *iov],
                chk,
            )
            for key, path, iov, size, chk in zip(keys, paths, iovs, sizes, check)
        ]
    if where is not None:
        items = [items[j] for j in where]
    codes = publish(items, threads) if items else []
    for _attempt in range(2):
        retry = [i for i, c in enumerate(codes) if c == _ENOENT]
        if not retry:
            break
        for d in dict.fromkeys(os.path.dirname(paths[i if where is None else where[i]]) for i in retry):
            try:
                publisher.makedirs(d)
            except OSError:
                pass  # the retry reports the error for each page
        for i, c in zip(retry, publish([items[i] for i in retry], threads)):
            codes[i] = c
    if where is None and not track and (not codes or min(codes) >= 0):  # the common case
        writes = codes.count(0)
        nbytes = sum(sizes) if writes == n else sum(s for s, c in zip(sizes, codes) if c == 0)
        tally.add("writes", writes)
        tally.add("skipped_writes", n - writes)
        tally.add("bytes_written", nbytes)
        return [True] * n, tally
    writes = skipped = nbytes = 0
    for i, code in enumerate(codes):
        pos = i if where is None else where[i]
        if code < 0:
            tally.error("write_errors", OSError(-code, os.strerror(-code)), paths[pos])
            continue
        out[pos] = True
        if code == 0:
            writes += 1
            nbytes += sizes[pos]
        else:
            skipped += 1
        if track:
            tally.touched.append((keys[pos], fmt.header_size(len(keys[pos])) + sizes[pos]))
    tally.add("writes", writes)
    tally.add("skipped_writes", skipped)
    tally.add("bytes_written", nbytes)
    return out, tally


def get_range(
    slow: Callable[..., tuple[list[bool], _Tally]],
    track: bool,
    threads: int,
    keys: Sequence[str],
    paths: list[str],
    iovs: list[list[Any]],
    sizes: list[int],
    posts: list[Post | None] | None,
) -> tuple[list[bool], _Tally]:
    """Read and verify a whole batch on ``threads`` threads; what does not verify goes to ``slow``.

    ``slow`` is the pure-Python reader (``_get_range``: these arguments after ``threads``, then
    ``lo, hi``), called for that one page: it re-reads it, tells a valid page of another size
    (a plain miss) from corruption, and quarantines the latter.
    """
    tally = _Tally()
    if not paths:
        codes: list[int] = []
    elif checksums_in_c():  # C builds each expected header from the key that ends its path
        codes = _fastio.read_verify_pages(list(zip(paths, iovs)), threads)
    else:
        parts = fmt.header_parts
        expected: list[bytes] = []  # each page's header with a zero checksum (not compared)
        for key, size in zip(keys, sizes):  # keys are ASCII (check_key)
            fixed, pad = parts(len(key), size)
            expected.append(fixed + key.encode() + pad)
        codes = _verify_in_python(paths, iovs, sizes, expected, threads)
    n = len(codes)
    if posts is None and not track and not any(codes):  # every page valid: the common case
        tally.add("hits", n)
        tally.add("bytes_read", sum(sizes))
        return [True] * n, tally
    out: list[bool] = []
    hits = misses = nbytes = 0
    for j, code in enumerate(codes):
        if code == 0:
            if posts is not None and posts[j] is not None:
                dst, scratch = posts[j]  # type: ignore[misc]
                dst.copy_(scratch.view(dst.shape))
            hits += 1
            nbytes += sizes[j]
            if track:
                tally.touched.append((keys[j], fmt.header_size(len(keys[j])) + sizes[j]))
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


def exists(paths: list[str], threads: int) -> list[bool]:
    """``os.access(path, F_OK)`` of every path, in C on ``threads`` threads."""
    return _fastio.exists_batch(paths, threads) if paths else []


def _verify_in_python(
    paths: list[str], iovs: list[list[Any]], sizes: list[int], expected: list[bytes], threads: int
) -> list[int]:
    """``read_verify_batch``'s result codes from ``read_batch`` plus checks in Python (no C XXH3)."""
    spare = bytearray(1)  # a byte read into it means trailing data (threads share it: never read)
    headers = [bytearray(len(e)) for e in expected]
    items = [(p, [h, *iov, spare]) for p, h, iov in zip(paths, headers, iovs)]
    checksum, xxh3 = fmt.checksum, fmt.xxh3_64
    codes: list[int] = []
    for code, hdr, want, iov, size in zip(_fastio.read_batch(items, threads), headers, expected, iovs, sizes):
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
