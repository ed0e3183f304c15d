"""Counters of the file backend: ``FileStats`` (public snapshot) and the per-worker tally."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["FileStats"]


@dataclass
class FileStats:
    """Counters of one backend instance (a snapshot; read ``backend.stats``)."""

    exists_checks: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    integrity_errors: int = 0
    size_mismatches: int = 0
    read_errors: int = 0
    sets: int = 0
    writes: int = 0
    skipped_writes: int = 0
    write_errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    cleared: int = 0
    temp_files_removed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Tally:
    """Per-range accumulator (one per worker), merged into :class:`FileStats` per batch."""

    __slots__ = ("counts", "errors", "first_error", "gone", "touched")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.errors = 0
        self.first_error = ""
        self.touched: list[tuple[str, int]] = []  # (key, bytes on disk) now most recent
        self.gone: list[str] = []  # keys whose files are gone

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def error(self, name: str, err: OSError, path: str) -> None:
        self.add(name)
        self.errors += 1
        if not self.first_error:
            self.first_error = f"{path}: [Errno {err.errno}] {err.strerror or err}"
