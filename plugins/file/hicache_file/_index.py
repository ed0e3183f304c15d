"""The LRU index behind ``max_bytes`` and the one-pass scan that rebuilds it on open.

The index maps every page file this process knows about (found by the open-time scan or
written since) to its size on disk, in least-recently-used order: a successful ``get`` or
``set`` moves a key to the young end; eviction pops from the old end. It lives in memory
only (about 260 bytes per file, key included); recency across restarts comes from file
modification times, which the scan sorts by.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from ._format import MARKER_NAME, TEMP_PREFIX, relpath

__all__ = ["LruIndex", "ScanResult", "scan_root"]

log = logging.getLogger("hicache.file")


class LruIndex:
    """Thread-safe LRU of ``key -> bytes on disk`` with a byte budget."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def load(self, entries: Iterable[tuple[str, int]]) -> None:
        """Append ``(key, size)`` pairs, oldest first (used once, after the scan)."""
        self.touch(entries)

    def touch(self, entries: Iterable[tuple[str, int]]) -> None:
        """Insert or refresh keys as most recently used."""
        with self._lock:
            d = self._entries
            for key, size in entries:
                old = d.pop(key, None)
                if old is not None:
                    self._total -= old
                d[key] = size
                self._total += size

    def discard(self, keys: Iterable[str]) -> None:
        """Forget keys whose files are gone (evicted elsewhere, corrupt, cleared)."""
        with self._lock:
            for key in keys:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._total -= old

    def drop_prefix(self, prefix: str) -> None:
        """Forget every key starting with ``prefix`` (a cleared namespace). O(index size)."""
        with self._lock:
            gone = [k for k in self._entries if k.startswith(prefix)]
            for key in gone:
                self._total -= self._entries.pop(key)

    def victims(self, reserve: int = 0) -> list[tuple[str, int]]:
        """Pop least-recently-used keys until the total plus ``reserve`` fits the budget.

        The caller deletes the returned files. Keys are removed from the index first, so two
        threads never pick the same victim.
        """
        out: list[tuple[str, int]] = []
        with self._lock:
            d = self._entries
            while d and self._total + reserve > self.max_bytes:
                key, size = d.popitem(last=False)
                self._total -= size
                out.append((key, size))
        return out


@dataclass
class ScanResult:
    """What one pass over the root found."""

    entries: list[tuple[str, int]]  # (key, bytes) oldest first
    files: int = 0
    temp_removed: int = 0
    seconds: float = 0.0


def scan_root(root: str, temp_max_age_s: float) -> ScanResult:
    """Walk ``root/<namespace>/<shard>/`` once; return page files oldest-first by mtime.

    Cost: one ``scandir`` per directory plus one ``stat`` per file; measured 0.14-0.16 s for
    20 000 files in one namespace's 16 shards on a 2-core VM with the directory entries cached
    (format 1's 4096 shards: 1.0 s, mostly per directory), so 5-10 us per file (~10 s per
    million). Temp files older
    than ``temp_max_age_s`` (left behind by killed writers) are deleted on the way; younger
    ones may belong to a live writer in another process and are kept. Files and directories
    vanishing during the walk (another process evicting or clearing) are skipped.
    """
    t0 = time.perf_counter()
    found: list[tuple[int, str, int]] = []
    cutoff_ns = time.time_ns() - int(temp_max_age_s * 1e9)
    removed = 0
    for ns in _subdirs(root):
        for shard in _subdirs(ns):
            try:
                it = os.scandir(shard)
            except OSError:
                continue
            with it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if entry.name.startswith(TEMP_PREFIX):
                        if st.st_mtime_ns < cutoff_ns:
                            try:
                                os.unlink(entry.path)
                                removed += 1
                            except OSError:
                                pass
                        continue
                    # only files at the place their name maps to are pages (eviction deletes
                    # by that path); anything else under the root is left alone
                    name = entry.name
                    if (
                        entry.is_file(follow_symlinks=False)
                        and not name.startswith(".")
                        and os.path.join(root, relpath(name)) == entry.path
                    ):
                        found.append((st.st_mtime_ns, name, st.st_size))
    found.sort()
    result = ScanResult([(k, s) for _, k, s in found], len(found), removed, time.perf_counter() - t0)
    log.debug(
        "hicache.file: scanned %s: %d pages, %d stale temp files removed, %.2fs",
        root,
        result.files,
        removed,
        result.seconds,
    )
    return result


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if e.name != MARKER_NAME and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
