"""A preallocated file of fixed-size page slots with a crash-safe, shareable key->slot index.

This is the local stand-in for a 3FS usrbio file plus its metadata service. Three files share
one path ``P`` (``{prefix}.{rank}.bin``):

``P`` (data, layout in :mod:`._layout`)
    A 4 KiB superblock (magic, geometry, a random file id, CRC), then ``num_slots`` slots of
    ``stride`` bytes. A slot is a 512-byte header -- state, key, payload length, sequence
    number, payload CRC32, header CRC32 -- followed by at most ``capacity`` payload bytes.
``P.idx`` (index log, format in :mod:`._indexlog`)
    A versioned header, then append-only records ``PUT(key, slot, seq)`` and ``FREE(slot,
    seq)``, each with its own magic and CRC32. Replaying the log rebuilds the index after a
    restart; other processes *tail* it to see new pages. A damaged record is skipped (its page
    is a miss, logged and counted in :attr:`SlotFile.integrity_errors`) and replay goes on with
    the next record that verifies; a writer then rewrites the log without it. A torn last
    record (crash mid-append) is dropped and truncated by the next writer. The log is compacted
    (rewritten and renamed into place) when it grows well past the live index.
``P.lock``
    ``flock`` target serialising writers (put, remove, compaction, creation) across processes.

Crash safety comes from ordering, not luck: a slot is written in full *before* its ``PUT``
record is appended, and a slot being reused is first released with a ``FREE`` record and
marked invalid on disk. So a writer killed at any point leaves either the old state or the
new page, never an index entry that points at a partial slot. Readers additionally verify the
header (key, sequence, length), the payload CRC32 and re-read the header after the payload
(a seqlock), so a slot overwritten by another process while being read is a miss, never
wrong bytes. Data survives process crashes; set ``fsync`` to also survive power loss.
A writer killed while creating ``P`` or rewriting ``P.idx`` leaves its temporary file
(``P.tmp.{pid}``, ``P.idx.tmp.{pid}``, possibly a fully preallocated data file); every open
removes those whose process no longer runs, under the writer lock.

A read that fails verification for any other reason is re-checked under the writer lock (no
writer can be mid-write then) after tailing the log. If the index still maps the key to the same
slot and sequence number and the slot still fails -- a bad header, a header naming another
page, or a payload CRC mismatch -- the slot is *corrupt*: it is released (a ``FREE`` record, as
eviction does) so the page stops being reported and the next write stores it again, the
per-file counter :attr:`SlotFile.integrity_errors` grows and a WARNING names the key. A valid
header for the key whose length differs from the requested size is a caller mismatch, not
corruption: a plain miss. ``exists`` reads the index only (no slot I/O).

Eviction is least-recently-used over this process's view (hits of exists/get/set refresh a
slot; pages written by other processes count as used when this process first sees them);
after a restart the order starts from write order (sequence numbers).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hicache_core import BackendIOError

from . import _indexlog as ilog
from ._indexlog import FREE, PUT, REC_SIZE
from ._layout import (
    HEADER_SIZE,
    INVALID,
    MAX_KEY,
    SUPERBLOCK_SIZE,
    VALID,
    crc,
    create_data_file,
    fsync_dir,
    make_dirs,
    pack_header,
    read_superblock,
    remove_dead_temps,
    slot_stride,
    temp_path,
    unpack_header,
)

__all__ = ["HEADER_SIZE", "SUPERBLOCK_SIZE", "SlotFile", "slot_stride"]

log = logging.getLogger("hicache.hf3fs")

COMPACT_MIN_BYTES = 1 << 20  # never compact a log smaller than this
COMPACT_RATIO = 4  # compact when the log is this many times larger than the live index

# Outcomes of one slot read (see SlotFile._read_slot).
_OK, _SIZE, _CHANGED, _SUSPECT = 0, 1, 2, 3


class SlotFile:
    """One preallocated slot file with its index log (see the module docstring).

    Thread-safe (one re-entrant lock per instance) and process-safe (``flock`` for writers,
    log tailing plus per-slot verification for readers). ``capacity``/``num_slots`` are used
    only when the file is created; an existing file keeps its geometry.
    """

    def __init__(
        self,
        path: Path,
        *,
        capacity: int | None,
        num_slots: int | None,
        fsync: bool = False,
        fallocate: bool = False,
        create: bool = True,
    ) -> None:
        self.path = Path(path)
        self.log_path = Path(f"{path}.idx")
        self.fsync = fsync
        self._lock = threading.RLock()
        make_dirs(self.path.parent)
        self._lock_fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        self._fd = self._log_fd = -1
        self.integrity_errors = 0
        """Pages of this file found corrupt by this process: slots failing their checks (released
        and reported as misses) and damaged index records (skipped, their pages are misses)."""
        try:
            with self._writer():
                remove_dead_temps(self.path, self.log_path)  # left by killed writers
                if not self.path.exists():
                    if not create or capacity is None or num_slots is None:
                        raise FileNotFoundError(str(self.path))
                    create_data_file(self.path, capacity, num_slots, fallocate)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
                self.geometry = read_superblock(self._fd, self.path)
                self._seed = ilog.seed(self.geometry.file_id)
                self._open_log(repair=True)
        except BaseException:
            self.close()
            raise
        self._scratch = bytearray(HEADER_SIZE + self.geometry.capacity)
        self._check = bytearray(HEADER_SIZE)

    # ------------------------------------------------------------ public API
    @property
    def capacity(self) -> int:
        """Largest payload (bytes) one slot holds."""
        return self.geometry.capacity

    def __len__(self) -> int:
        with self._lock:
            self._tail()
            return len(self._index)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a committed slot (a hit refreshes its LRU position)."""
        with self._lock:
            self._tail()
            out = []
            for k in keys:
                ent = self._index.get(k)
                out.append(ent is not None)
                if ent is not None:
                    self._lru.move_to_end(ent[0])
            return out

    def get(self, items: Sequence[tuple[str, int]], deliver: Callable[[int, memoryview], None]) -> list[bool]:
        """Read ``(key, nbytes)`` items; call ``deliver(i, payload)`` for each verified page.

        A page is delivered only if its slot header names this key and sequence number, its
        length is exactly ``nbytes``, its payload CRC matches and the header did not change
        while the payload was read. A page that fails for another reason than a concurrent
        overwrite or a size mismatch is confirmed under the writer lock and, if corrupt,
        released and counted (module docstring).
        """
        with self._lock:
            self._tail()
            out = [False] * len(items)
            for i, (key, nbytes) in enumerate(items):
                ent = self._index.get(key)
                if ent is None or nbytes > self.geometry.capacity:
                    continue
                status, payload = self._read_slot(ent[0], key.encode(), ent[1], nbytes)
                if status == _SUSPECT:
                    payload = self._confirm(key, ent, nbytes)
                if payload is None:
                    continue
                deliver(i, payload)
                self._lru.move_to_end(ent[0])
                out[i] = True
            return out

    def put(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """Publish ``(key, payload)`` items; keys already present are skipped and reported True.

        A payload larger than :attr:`capacity` fails (False). When the file is full the least
        recently used slots are reused, never a slot written earlier in the same call, so a
        batch larger than the file fails its tail instead of overwriting its head.
        """
        out = [False] * len(items)
        with self._lock, self._writer():
            self._tail(repair=True)
            planned: dict[str, list[int]] = {}
            plan: list[tuple[str, memoryview, int, bool]] = []
            frees: list[bytes] = []
            protected: set[int] = set()
            for i, (key, payload) in enumerate(items):
                ent = self._index.get(key)
                if ent is not None:
                    self._lru.move_to_end(ent[0])
                    out[i] = True
                    continue
                if key in planned:
                    planned[key].append(i)
                    continue
                if len(payload) > self.geometry.capacity or len(key.encode()) > MAX_KEY:
                    continue
                got = self._allocate(protected)
                if got is None:
                    continue
                slot, fresh, victim = got
                protected.add(slot)
                if victim is not None:
                    self._seq += 1
                    frees.append(self._record(FREE, slot, self._seq))
                    self._unmap(slot)
                planned[key] = [i]
                plan.append((key, payload, slot, fresh))
            if frees:
                self._append(b"".join(frees))
            puts: list[bytes] = []
            done: list[tuple[str, int, int]] = []
            for key, payload, slot, fresh in plan:
                self._seq += 1
                try:
                    self._write_slot(slot, key.encode(), payload, self._seq, invalidate=not fresh)
                except OSError as err:
                    log.error("hicache hf3fs: writing slot %d of %s failed: %s", slot, self.path, err)
                    self._free.add(slot)
                    continue
                puts.append(self._record(PUT, slot, self._seq, key.encode()))
                done.append((key, slot, self._seq))
            if puts:
                if self.fsync:
                    os.fdatasync(self._fd)
                self._append(b"".join(puts))
            for key, slot, seq in done:
                self._apply_put(key, slot, seq)
                for i in planned[key]:
                    out[i] = True
            self._maybe_compact()
        return out

    def remove(self, predicate: Callable[[str], bool]) -> int:
        """Release every slot whose key matches ``predicate``; returns how many."""
        with self._lock, self._writer():
            self._tail(repair=True)
            victims = [(k, s) for k, (s, _) in self._index.items() if predicate(k)]
            recs = []
            for _, slot in victims:
                self._seq += 1
                recs.append(self._record(FREE, slot, self._seq))
            if recs:
                self._append(b"".join(recs))
                for _, slot in victims:
                    self._unmap(slot)
                    self._free.add(slot)
                self._maybe_compact()
            return len(victims)

    def keys(self) -> list[str]:
        """The committed keys (for tests and diagnostics)."""
        with self._lock:
            self._tail()
            return list(self._index)

    def slot_of(self, key: str) -> int | None:
        """The slot holding ``key`` (for tests and diagnostics)."""
        with self._lock:
            self._tail()
            ent = self._index.get(key)
            return None if ent is None else ent[0]

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s header in the data file."""
        return SUPERBLOCK_SIZE + slot * self.geometry.stride

    def close(self) -> None:
        """Close the files (idempotent)."""
        for attr in ("_fd", "_log_fd", "_lock_fd"):
            fd = getattr(self, attr, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)

    # ------------------------------------------------------------ creation
    @contextlib.contextmanager
    def _writer(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------ index log
    def _reset_index(self) -> None:
        self._index: dict[str, tuple[int, int]] = {}
        self._owner: dict[int, str] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._free: set[int] = set()
        self._hwm = 0
        self._seq = 0
        self._live_bytes = 0  # size of a compacted log's records

    def _record(self, kind: int, slot: int, seq: int, key: bytes = b"") -> bytes:
        return ilog.record(self._seed, kind, slot, seq, key)

    def _open_log(self, repair: bool) -> None:
        """(Re)open the log and replay it from the start. Call with the writer lock if ``repair``."""
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1
        self._reset_index()
        header = ilog.header(self.geometry.file_id)
        try:
            fd = os.open(self.log_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1
        if fd >= 0 and os.pread(fd, len(header), 0) == header:
            self._log_fd, self._log_ino, self._log_off = fd, os.fstat(fd).st_ino, len(header)
            self._tail(repair=repair)
            return
        if not repair:  # missing, old, damaged or foreign: decide with no writer active
            if fd >= 0:
                os.close(fd)
            with self._writer():
                self._open_log(repair=True)
            return
        if fd < 0:
            self._rewrite_log()
            return
        try:
            data = os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)
        kind, version = ilog.classify(data, self.geometry.file_id)
        if kind is ilog.Header.NEWER:
            raise BackendIOError(
                f"{self.log_path} is an index log of format {version}, written by a newer "
                f"hicache-hf3fs-stub; this one reads formats 1 and {ilog.VERSION}. Upgrade, or delete "
                f"{self.path} and its .idx to start empty"
            )
        if kind is ilog.Header.V1:
            replay = ilog.replay_v1(data[ilog.v1_records_offset() :])
            log.info("hicache hf3fs: upgrading %s from index format 1 to %d", self.log_path, ilog.VERSION)
        elif kind is ilog.Header.DAMAGED:
            replay = ilog.replay(data[ilog.HEADER_SIZE :], self._seed)
            self._report_damage(replay, ilog.HEADER_SIZE, header=True)
        else:
            replay = ilog.Replay()
            log.warning(
                "hicache hf3fs: %s belongs to another data file; starting an empty index", self.log_path
            )
        self._apply(replay.records)
        self._rewrite_log()

    def _write_log(self, content: bytes) -> int:
        tmp = temp_path(self.log_path)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.replace(tmp, self.log_path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()  # e.g. the disk is full: leave nothing behind
            raise
        fsync_dir(self.path)
        return fd

    def _tail(self, repair: bool = False) -> None:
        """Apply records appended since the last call (others' writes); reload after compaction."""
        try:
            ino = os.stat(self.log_path).st_ino
        except FileNotFoundError:
            ino = -1
        if ino != self._log_ino or os.fstat(self._log_fd).st_size < self._log_off:
            self._open_log(repair=repair)
            return
        size = os.fstat(self._log_fd).st_size
        if size == self._log_off:
            return
        data = os.pread(self._log_fd, size - self._log_off, self._log_off)
        replay = ilog.replay(data, self._seed)
        if replay.damaged and not repair:
            with self._writer():  # damage, or a race with an appender? Decide with none active.
                self._tail(repair=True)
            return
        self._apply(replay.records)
        start, self._log_off = self._log_off, self._log_off + replay.consumed
        if repair and replay.consumed < len(data):
            # A writer died mid-append (we hold the writer lock, so nobody is appending now).
            log.warning("hicache hf3fs: dropping a torn index record at the end of %s", self.log_path)
            os.ftruncate(self._log_fd, self._log_off)
        if replay.damaged:
            self._report_damage(replay, start)
            self._rewrite_log()  # drop the damage, so it is reported once

    def _report_damage(self, replay: ilog.Replay, base: int, header: bool = False) -> None:
        self.integrity_errors += len(replay.damaged) + header
        if header:
            log.warning("hicache hf3fs: the header of %s is corrupt; rewriting it", self.log_path)
        for off, n in replay.damaged:
            log.warning(
                "hicache hf3fs: skipped %d corrupt byte(s) at offset %d of %s (a damaged index "
                "record: its page is a miss); the records after it are kept",
                n,
                base + off,
                self.log_path,
            )

    def _apply(self, records: list[ilog.Record]) -> None:
        for kind, slot, seq, key in records:
            if not 0 <= slot < self.geometry.num_slots:
                continue
            if kind == PUT:
                self._apply_put(key, slot, seq)
            else:
                self._unmap(slot)
                self._grow(slot)
                self._free.add(slot)
                self._seq = max(self._seq, seq)

    def _grow(self, slot: int) -> None:
        """Note that ``slot`` was used: slots below it that nobody committed are free."""
        if slot >= self._hwm:
            self._free.update(range(self._hwm, slot))  # slots a crashed writer never committed
            self._hwm = slot + 1

    def _apply_put(self, key: str, slot: int, seq: int) -> None:
        old = self._index.get(key)
        if old is not None and old[0] != slot:
            self._unmap(old[0])
            self._free.add(old[0])
        self._unmap(slot)
        self._index[key] = (slot, seq)
        self._live_bytes += REC_SIZE + len(key)
        self._owner[slot] = key
        self._lru[slot] = None
        self._lru.move_to_end(slot)
        self._free.discard(slot)
        self._grow(slot)
        self._seq = max(self._seq, seq)

    def _unmap(self, slot: int) -> None:
        key = self._owner.pop(slot, None)
        if key is not None:
            self._index.pop(key, None)
            self._lru.pop(slot, None)
            self._live_bytes -= REC_SIZE + len(key)

    def _append(self, blob: bytes) -> None:
        os.lseek(self._log_fd, 0, os.SEEK_END)
        view = memoryview(blob)
        while view:
            view = view[os.write(self._log_fd, view) :]
        if self.fsync:
            os.fsync(self._log_fd)
        self._log_off = os.fstat(self._log_fd).st_size

    def _maybe_compact(self) -> None:
        size = self._log_off
        if size < COMPACT_MIN_BYTES or size < COMPACT_RATIO * (ilog.HEADER_SIZE + self._live_bytes):
            return
        self._rewrite_log()
        log.info("hicache hf3fs: compacted %s from %d to %d bytes", self.log_path, size, self._log_off)

    def _rewrite_log(self) -> None:
        """Replace the log by the live index (header, then one PUT per entry). Writer lock held."""
        entries = sorted(self._index.items(), key=lambda kv: kv[1][1])
        content = ilog.header(self.geometry.file_id) + b"".join(
            self._record(PUT, slot, seq, key.encode()) for key, (slot, seq) in entries
        )
        fd = self._write_log(content)
        if self._log_fd >= 0:
            os.close(self._log_fd)
        self._log_fd = fd
        self._log_ino = os.fstat(fd).st_ino
        self._log_off = len(content)

    # ------------------------------------------------------------ slots
    def _allocate(self, protected: set[int]) -> tuple[int, bool, str | None] | None:
        """``(slot, never_used, evicted_key)``, or ``None`` when every slot is protected."""
        if self._free:
            return self._free.pop(), False, None
        if self._hwm < self.geometry.num_slots:
            self._hwm += 1
            return self._hwm - 1, True, None
        for slot in self._lru:
            if slot not in protected:
                return slot, False, self._owner.get(slot)
        return None

    def _write_slot(self, slot: int, key: bytes, payload: memoryview, seq: int, invalidate: bool) -> None:
        off = self.slot_offset(slot)
        if invalidate:  # readers that still map the old key must see the slot change
            os.pwrite(self._fd, pack_header(INVALID, b"", 0, seq, 0), off)
        n = 0
        while n < len(payload):
            n += os.pwrite(self._fd, payload[n:], off + HEADER_SIZE + n)
        os.pwrite(self._fd, pack_header(VALID, key, len(payload), seq, crc(payload)), off)

    def _read_slot(self, slot: int, key: bytes, seq: int, nbytes: int) -> tuple[int, memoryview | None]:
        """``(_OK, payload)``, or ``(reason, None)``: ``_SIZE`` (a valid header for this page
        with another length), ``_CHANGED`` (the header changed while the payload was read: a
        concurrent overwrite) or ``_SUSPECT`` (short read, bad or foreign header, CRC mismatch:
        corrupt, unless the index is stale -- :meth:`_confirm` decides)."""
        off = self.slot_offset(slot)
        view = memoryview(self._scratch)[: HEADER_SIZE + nbytes]
        if os.preadv(self._fd, [view], off) != len(view):
            return _SUSPECT, None
        head = unpack_header(view)
        if head is None or head[:2] != (VALID, key) or head[3] != seq:
            return _SUSPECT, None
        if head[2] != nbytes:
            return _SIZE, None
        payload = view[HEADER_SIZE:]
        crc_ok = crc(payload) == head[4]
        if os.preadv(self._fd, [self._check], off) != HEADER_SIZE or self._check != view[:HEADER_SIZE]:
            return _CHANGED, None  # rewritten while we read it
        return (_OK, payload) if crc_ok else (_SUSPECT, None)

    def _confirm(self, key: str, ent: tuple[int, int], nbytes: int) -> memoryview | None:
        """Re-read a suspect slot with no writer active; release it if it is really corrupt.

        Returns the payload if the re-read verifies (the first read raced a writer), ``None``
        otherwise. Called with ``self._lock`` held.
        """
        slot, seq = ent
        with self._writer():
            self._tail(repair=True)
            if self._index.get(key) != ent:
                return None  # freed or rewritten by another process meanwhile: a plain miss
            status, payload = self._read_slot(slot, key.encode(), seq, nbytes)
            if status != _SUSPECT:
                return payload  # _OK, or a size mismatch (None)
            self._seq += 1
            self._append(self._record(FREE, slot, self._seq))
            self._unmap(slot)
            self._free.add(slot)
            self._maybe_compact()
        self.integrity_errors += 1
        log.warning(
            "hicache hf3fs: corrupt page %r in slot %d of %s (bad slot header or payload CRC); "
            "released it, so it is a miss and the next backup rewrites it",
            key,
            slot,
            self.path,
        )
        return None
