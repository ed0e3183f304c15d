"""``FileOptions``: the validated options of the file backend."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hicache_core.config import expand_path

__all__ = ["FileOptions", "default_root", "parse_size"]

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?B?)\s*", re.IGNORECASE)
_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def default_root() -> str:
    """``<user cache dir>/hicache/file`` (for example ``~/.cache/hicache/file`` on Linux)."""
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("hicache", appauthor=False), "file")


def parse_size(value: Any) -> Any:
    """Accept an int or a size string: ``"512MiB"``, ``"10G"``, ``"1.5TB"`` (1024-based units)."""
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m is None:
            raise ValueError(f"cannot parse size {value!r}; use bytes or e.g. '512MiB', '10GiB'")
        return int(float(m.group(1)) * 1024 ** _UNITS[m.group(2).upper()])
    if isinstance(value, bool):  # an int subclass: `true` would be a 1-byte budget
        raise ValueError(f"a size must be bytes (an int) or a string such as '512MiB', got {value!r}")
    return value


class FileOptions(BaseModel):
    """Options of the ``file`` backend (every field has a default).

    ``root``: directory holding the pages (created if missing); default
    ``<user cache dir>/hicache/file``. Every process opening the same root shares the pages.
    It may be (or pass through) a symlink: it is resolved once, at open; nothing below it is
    ever reached through a symlink.
    ``max_bytes``: optional byte budget over the pages in ``root`` (``"files"``: the page files,
    headers included; ``"segments"``: every file in ``segments/`` and ``index/``), enforced with
    LRU eviction (``layout="segments"``: whole segments, oldest first, their live pages dropped);
    ``None`` means unbounded. With ``"files"``, setting it makes open scan ``root`` once to
    rebuild the index (5-10 us per file), and each process enforces it over the files it knows:
    N processes open on one root at once may hold N budgets (plus a batch each). With
    ``"segments"`` it holds for the root: N stores writing at once exceed it by at most
    ``N * (max_bytes / 8 + max_bytes / 16 + one batch)``. See ``plugins/file/README.md``.
    ``fsync``: ``fsync`` each page and its directory before reporting it stored (``"segments"``:
    the batch's segment data, its index records and any new segment or log's directory entry,
    synced in parallel), and the parent of every directory the store creates, the root and its
    missing parents included (durable across power loss; without it, a crash of the process still never exposes a torn page, and a page
    damaged by power loss is caught by its checksum and read as a miss).
    ``io_threads``: threads moving one batch in parallel, the caller's included (1 = inline in
    the caller's thread); the other threads are a pool kept until ``close``.
    ``parallel_min_bytes``: batches with fewer payload bytes run inline, where a thread
    hand-off costs more than it saves.
    ``temp_max_age_s``: every open removes the temp files of killed writers (``publish="rename"``
    only; kept in the root's ``.hicache-tmp`` directory): at once when the name says the
    writer ran on this host and PID namespace and its process is gone, else once they are
    older than this (they may belong to a live writer on another host).
    ``publish``: how a page appears atomically: ``"tmpfile"`` writes an unnamed ``O_TMPFILE``
    inode and links it (Linux; nothing is left behind by a killed writer, one directory
    operation per page), ``"rename"`` writes a named temp file and renames it (portable),
    ``"auto"`` (default) probes the root at open and uses ``tmpfile`` when it works.
    ``exact_skipped``: ``False`` (default): ``set`` skips a page that is already stored itself
    (an ``faccessat(2)`` on the I/O thread that would write it, no bytes written), so the
    controller's ``backup`` makes no separate existence pass and ``TransferResult.skipped``
    stays 0 (``FileBackend.stats.skipped_writes`` counts those pages). ``True``: the backend
    declares ``set_skips_existing=False``, so ``backup`` first asks which pages exist and
    ``skipped`` counts them exactly, at the cost of that extra batch (one ``faccessat(2)`` per
    key before the writes).
    ``layout``: ``"files"`` (default) stores one file per page component
    (``<namespace>/<shard>/<key>``, any POSIX filesystem); ``"segments"`` appends the pages of a
    batch to large segment files (all components and pools of a page together), one per opened
    store, with a per-store append-only index log whose records are checksummed one by one, and
    reads them with ``preadv``, several runs in flight, ``O_DIRECT`` where the filesystem takes
    it. Eviction under ``max_bytes`` removes whole segments, oldest first, and drops their live
    pages. A root keeps the layout it was created with; opening it with the other one raises
    ``FileRootError``. ``publish`` does not apply to ``"segments"``; ``exact_skipped`` works as
    in ``"files"``. See ``plugins/file/README.md`` ("Segment layout") for the format and the
    guarantees.
    ``direct_io`` (``"segments"`` only): ``True``: ``O_DIRECT`` for segment reads and writes when
    a probe at open succeeds (it fails on tmpfs before Linux 6.6 and on some network filesystems:
    then buffered I/O, with one log line naming the fallback); ``"auto"`` (default): ``O_DIRECT``
    writes only with ``fsync`` (buffered otherwise, so the pages stay in the page cache), and
    a read run that the page cache holds whole (``cachestat(2)``) is read from there, others with ``O_DIRECT``;
    ``False``: always buffered (pages then stay in the page cache).
    """

    model_config = ConfigDict(extra="forbid", defer_build=True)

    root: str | None = Field(None, description="directory holding the pages")
    max_bytes: int | None = Field(None, ge=1, description="byte budget (LRU eviction); None = unbounded")
    fsync: bool = Field(False, description="fsync pages and directories before reporting success")
    io_threads: int = Field(
        default_factory=lambda: max(2, min(4, os.cpu_count() or 1)),
        ge=1,
        le=64,
        description="parallel I/O threads per batch",
    )
    parallel_min_bytes: int = Field(512 * 1024, ge=0, description="smaller batches run inline")
    temp_max_age_s: float = Field(
        3600.0, gt=0, description="age after which temp files of other hosts' writers go"
    )
    publish: Literal["auto", "tmpfile", "rename"] = Field("auto", description="atomic publish method")
    exact_skipped: bool = Field(
        False, description="backup checks existence first, so TransferResult.skipped counts stored pages"
    )

    layout: Literal["files", "segments"] = Field("files", description="one file per component, or segments")
    direct_io: Literal["auto"] | bool = Field(
        "auto", description="segments: O_DIRECT where the filesystem allows it ('auto': see the docstring)"
    )

    @field_validator("root")
    @classmethod
    def _expand_root(cls, value: str | None) -> str | None:
        return None if value is None else expand_path(value, "root")

    @field_validator("max_bytes", "parallel_min_bytes", mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> Any:
        return parse_size(value)

    def resolved_root(self) -> str:
        """``root`` or the default, as an absolute path."""
        return self.root if self.root is not None else default_root()
