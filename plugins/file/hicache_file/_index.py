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
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from hicache_core import KeyFormatError, check_key

from ._dirs import DirTree, open_dir
from ._format import TEMP_PREFIX, location

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


def scan_root(tree: DirTree, temp_max_age_s: float) -> ScanResult:
    """Walk ``root/<namespace>/<shard>/`` once; return page files oldest-first by mtime.

    Cost: one ``scandir`` per directory plus one ``stat`` per file; measured 0.14-0.16 s for
    20 000 files in one namespace's 16 shards on a 2-core VM with the directory entries cached
    (format 1's 4096 shards: 1.0 s, mostly per directory), so 5-10 us per file (~10 s per
    million). Every directory is opened relative to its parent's fd with ``O_NOFOLLOW``: a
    symlink in the tree is never descended into, and only regular files named by a valid key at
    the place that key maps to are pages (eviction deletes by that place). Temp files that
    older versions left in shard directories and that are older than ``temp_max_age_s`` are
    deleted on the way. Files and directories vanishing during the walk (another process
    evicting or clearing) are skipped.
    """
    t0 = time.perf_counter()
    found: list[tuple[int, str, int]] = []
    cutoff_ns = time.time_ns() - int(temp_max_age_s * 1e9)
    removed = 0
    rfd = tree.refresh(tree.top, False)
    for ns in _subdirs(rfd):
        nsfd = _opendir(ns, rfd)
        if nsfd is None:
            continue
        try:
            for shard in _subdirs(nsfd):
                sfd = _opendir(shard, nsfd)
                if sfd is None:
                    continue
                try:
                    removed += _scan_shard(sfd, ns, shard, cutoff_ns, found)
                finally:
                    os.close(sfd)
        finally:
            os.close(nsfd)
    found.sort()
    result = ScanResult([(k, s) for _, k, s in found], len(found), removed, time.perf_counter() - t0)
    log.debug(
        "hicache.file: scanned %s: %d pages, %d stale temp files removed, %.2fs",
        tree.root,
        result.files,
        removed,
        result.seconds,
    )
    return result


def _scan_shard(sfd: int, ns: str, shard: str, cutoff_ns: int, found: list[tuple[int, str, int]]) -> int:
    """Append the pages of one shard directory to ``found``; return the temp files removed."""
    removed = 0
    try:
        it = os.scandir(sfd)
    except OSError:
        return 0
    with it:
        for entry in it:
            name = entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if name.startswith(TEMP_PREFIX):
                if st.st_mtime_ns < cutoff_ns and not stat.S_ISDIR(st.st_mode):
                    try:
                        os.unlink(name, dir_fd=sfd)
                        removed += 1
                    except OSError:
                        pass
                continue
            if stat.S_ISREG(st.st_mode) and location(name) == (ns, shard) and _is_key(name):
                found.append((st.st_mtime_ns, name, st.st_size))
    return removed


def _is_key(name: str) -> bool:
    try:
        check_key(name)
    except KeyFormatError:
        return False
    return True


def _opendir(name: str, parent_fd: int) -> int | None:
    try:
        return open_dir(name, parent_fd)
    except OSError:  # gone, or a symlink / file in its place: never descended into
        return None


def _subdirs(dfd: int) -> list[str]:
    """Names of the real directories in ``dfd`` (not symlinks), except ours (``.*``)."""
    try:
        with os.scandir(dfd) as it:
            return [e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
