"""What every peer worker shares: the request/answer protocol, the pages, the timing rules.

Standard library only: each worker runs under its own peer's venv (LMCache, SGLang, NIXL or
hicache's own), so this module must import under any of them.

Protocol: the parent writes one JSON object on the worker's stdin::

    {"seed": int, "root": str, "setting": str, "cases": [{"page_bytes": int, "pages": int}, ...]}

and reads one JSON object from the worker's stdout (everything the peer's library prints, even
from C, goes to stderr: ``serve`` moves fd 1 there before the peer is imported)::

    {"versions": {...}, "setting": str, "error": str | None,
     "cases": [{"page_bytes", "pages", "bytes", "durable_s", "cold_s", "warm_s",
                "pages_read_cold", "pages_read_warm", "wrong_pages", "error"}, ...]}

The same rule for every contender, per case, in a fresh directory under ``root``:

1. untimed: the contender is built, its source buffers filled with the pages; ``os.sync()``;
2. *durable*: timed ``write()`` (returns when the contender says every page is stored) and
   then ``fdatasync`` of every regular file under the case directory and ``fsync`` of every
   directory there (none of the peers makes its writes durable by itself);
3. untimed: every file under the case directory ``fdatasync``-ed and dropped from the page
   cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (works without root); destination zeroed;
4. *cold*: timed ``read()``, then every byte compared (untimed);
5. destination zeroed; *warm*: timed ``read()`` (now from the page cache), every byte compared.

The pages are the same bytes in every worker: ``pages(seed, page_bytes, n)`` derives them from
``random.Random(seed)`` (stable across Python builds), page ``i`` being the window at offset
``i * STRIDE`` of one random block, so no two pages are equal and a page read from another's
place is caught.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

STRIDE = 4096 + 64


class Contender(Protocol):
    """One store under test, for one case (page size and count)."""

    def fill(self, i: int, data: memoryview) -> None:
        """Untimed: put page ``i``'s bytes into the contender's source buffer."""

    def write(self) -> None:
        """Timed: store every page; return when the store reports them all stored."""

    def clear(self) -> None:
        """Untimed: zero the destination buffers."""

    def read(self) -> int:
        """Timed: read every page into the destination; return how many pages were read."""

    def page(self, i: int) -> bytes | memoryview:
        """Untimed: the bytes read for page ``i``."""

    def close(self) -> None:
        """Release everything (files stay)."""

    # Optional: ``phase`` ("cold"/"warm") is set before each timed read; ``prepare_warm()``, if
    # defined, runs untimed before the warm read.


Factory = Callable[[str, int, int, str], Contender]


class Pages:
    """The benchmark's pages: ``n`` windows of one random block."""

    def __init__(self, seed: int, page_bytes: int, n: int) -> None:
        self.page_bytes = page_bytes
        self.n = n
        self.block = memoryview(
            random.Random(seed * 1_000_003 + page_bytes).randbytes(page_bytes + n * STRIDE)
        )

    def __getitem__(self, i: int) -> memoryview:
        return self.block[i * STRIDE : i * STRIDE + self.page_bytes]


def walk(root: str) -> tuple[list[str], list[str]]:
    """Every regular file and every directory under ``root`` (``root`` included)."""
    files, dirs = [], []
    for d, subdirs, names in os.walk(root):
        dirs.append(d)
        for name in names:
            p = os.path.join(d, name)
            if os.path.isfile(p) and not os.path.islink(p):
                files.append(p)
        subdirs[:] = [s for s in subdirs if not os.path.islink(os.path.join(d, s))]
    return files, dirs


def make_durable(root: str) -> int:
    """``fdatasync`` every file and ``fsync`` every directory under ``root``; returns the file count."""
    files, dirs = walk(root)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return len(files)


def drop_cache(root: str) -> int:
    """Write back and drop from the page cache every file under ``root``; returns the count."""
    files, _ = walk(root)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def _wrong(c: Contender, pages: Pages) -> int:
    return sum(1 for i in range(pages.n) if bytes(c.page(i)) != pages[i])


def run_case(factory: Factory, seed: int, root: str, setting: str, page_bytes: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"page_bytes": page_bytes, "pages": n, "bytes": page_bytes * n, "error": None}
    pages = Pages(seed, page_bytes, n)
    case_root = os.path.join(root, f"p{page_bytes}")
    os.makedirs(case_root, exist_ok=True)
    c = factory(case_root, page_bytes, n, setting)
    try:
        for i in range(n):
            c.fill(i, pages[i])
        os.sync()
        t0 = time.perf_counter()
        c.write()
        out["files"] = make_durable(case_root)
        out["durable_s"] = time.perf_counter() - t0
        for phase in ("cold", "warm"):
            if phase == "cold":
                drop_cache(case_root)
            elif hasattr(c, "prepare_warm"):
                c.prepare_warm()  # a contender whose cold read bypassed the page cache fills it
            c.phase = phase  # type: ignore[attr-defined]
            c.clear()
            t0 = time.perf_counter()
            got = c.read()
            out[f"{phase}_s"] = time.perf_counter() - t0
            out[f"pages_read_{phase}"] = got
            wrong = _wrong(c, pages)
            out["wrong_pages"] = max(out.get("wrong_pages", 0), wrong)
            if got != n or wrong:
                out["error"] = f"{phase} read: {got}/{n} pages reported read, {wrong} pages with wrong bytes"
                break
    finally:
        c.close()
    return out


def serve(factory_loader: Callable[[], tuple[Factory, dict[str, str]]]) -> int:
    """Read the request, run every case, answer; the peer is imported by ``factory_loader``."""
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # libraries' prints (Python and C) go to stderr, stdout carries the answer
    sys.stdout = sys.stderr
    req = json.loads(sys.stdin.read())
    result: dict[str, Any] = {"versions": {}, "setting": req.get("setting", ""), "error": None, "cases": []}
    try:
        factory, versions = factory_loader()
        result["versions"] = versions
        for case in req["cases"]:
            try:
                result["cases"].append(
                    run_case(
                        factory,
                        req["seed"],
                        req["root"],
                        req.get("setting", ""),
                        case["page_bytes"],
                        case["pages"],
                    )
                )
            except Exception as err:
                traceback.print_exc()
                result["cases"].append({**case, "error": f"{type(err).__name__}: {err}"})
    except Exception as err:
        traceback.print_exc()
        result["error"] = f"{type(err).__name__}: {err}"
    answer.write(json.dumps(result) + "\n")
    answer.flush()
    return 0
