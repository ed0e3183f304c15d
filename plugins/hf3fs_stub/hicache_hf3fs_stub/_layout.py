"""On-disk layout of an hf3fs data file ``{prefix}.{rank}.bin``: superblock and slot headers.

A 4 KiB superblock (magic, version 1, header size, geometry, a random file id, CRC32), then
``num_slots`` slots of ``stride`` bytes. A slot is a 512-byte header -- magic, state, key
length, payload length, sequence number, payload CRC32, header CRC32, key -- followed by at
most ``capacity`` payload bytes. The index log that maps keys to slots is :mod:`._indexlog`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

from hicache_core import BackendIOError

__all__ = [
    "HEADER_SIZE",
    "INVALID",
    "MAX_KEY",
    "SUPERBLOCK_SIZE",
    "VALID",
    "Geometry",
    "crc",
    "create_data_file",
    "fsync_dir",
    "make_dirs",
    "pack_header",
    "read_superblock",
    "remove_dead_temps",
    "slot_stride",
    "temp_path",
    "unpack_header",
]

log = logging.getLogger("hicache.hf3fs")

SUPERBLOCK_SIZE = 4096
HEADER_SIZE = 512
ALIGN = 4096
MAX_KEY = 255

_SB = struct.Struct("<16sIIQQQ16s")  # magic, version, header size, capacity, stride, slots, file id
_SB_MAGIC = b"HICACHE-HF3FS-v1"
_HDR = struct.Struct("<4sBxHQQII")  # magic, state, key length, payload length, seq, payload crc, hdr crc
_HDR_MAGIC = b"H3SL"
VALID, INVALID = 1, 0


def slot_stride(capacity: int) -> int:
    """Bytes of one slot holding up to ``capacity`` payload bytes (4 KiB aligned)."""
    return (HEADER_SIZE + capacity + ALIGN - 1) // ALIGN * ALIGN


def crc(*parts: bytes | memoryview) -> int:
    """CRC32 of the concatenation of ``parts``."""
    c = 0
    for p in parts:
        c = zlib.crc32(p, c)
    return c


def pack_header(state: int, key: bytes, length: int, seq: int, payload_crc: int) -> bytes:
    """A slot header (``HEADER_SIZE`` bytes)."""
    body = _HDR.pack(_HDR_MAGIC, state, len(key), length, seq, payload_crc, 0)[:-4]
    head = body + struct.pack("<I", crc(body, key)) + key
    return head.ljust(HEADER_SIZE, b"\0")


def unpack_header(raw: bytes | memoryview) -> tuple[int, bytes, int, int, int] | None:
    """``(state, key, length, seq, payload_crc)`` of a well-formed header, else ``None``."""
    magic, state, klen, length, seq, pcrc, hcrc = _HDR.unpack_from(raw, 0)
    if magic != _HDR_MAGIC or klen > MAX_KEY:
        return None
    key = bytes(raw[_HDR.size : _HDR.size + klen])
    if crc(bytes(raw[: _HDR.size - 4]), key) != hcrc:
        return None
    return state, key, length, seq, pcrc


@dataclass(frozen=True)
class Geometry:
    """Layout of a slot file: payload capacity per slot, slot stride and slot count."""

    capacity: int
    stride: int
    num_slots: int
    file_id: bytes

    @property
    def size(self) -> int:
        return SUPERBLOCK_SIZE + self.num_slots * self.stride


def fsync_dir(path: Path) -> None:
    """fsync the directory holding ``path`` (makes a rename durable)."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def make_dirs(path: Path) -> None:
    """Create directory ``path`` and its missing parents, fsyncing the parent of each one created.

    Always, not only with ``fsync``: the data file's creation is always made durable
    (:func:`create_data_file`), which is worth nothing if a power loss can take the directory
    holding it; it costs one fsync per new directory, once per prefix.
    """
    missing = []
    p = path
    while not p.is_dir() and p.parent != p:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not d.is_dir():
                raise
            # made by a racing process: fsync anyway, we may write into it before it syncs
        fsync_dir(d)


def temp_path(path: Path) -> Path:
    """The name this process writes ``path`` under before renaming it into place."""
    return Path(f"{path}.tmp.{os.getpid()}")


def remove_dead_temps(*paths: Path) -> int:
    """Unlink the :func:`temp_path` files of ``paths`` (one directory) whose process is gone.

    Call with the writer lock held: temp files are created and renamed (or unlinked) under it,
    so one found then was left by a killed writer. A name whose pid is a live process is kept
    all the same (a reused pid); only exact names ``{name}.tmp.{pid}`` are looked at, and they
    are unlinked relative to the directory (a symlink is removed, never followed). Best effort:
    an error is logged, never raised. Returns how many were removed.
    """
    names = "|".join(re.escape(p.name) for p in paths)
    pattern = re.compile(rf"(?:{names})\.tmp\.([1-9][0-9]{{0,8}})")
    parent = paths[0].parent
    try:
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        log.warning("hicache hf3fs: cannot look for stale temporary files in %s: %s", parent, err)
        return 0
    removed = 0
    try:
        for name in os.listdir(dfd):
            m = pattern.fullmatch(name)
            if m is None or _alive(int(m[1])):
                continue
            try:
                size = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                continue
            except OSError as err:  # e.g. a directory of that name
                log.warning("hicache hf3fs: cannot remove stale %s: %s", parent / name, err)
                continue
            removed += 1
            log.info(
                "hicache hf3fs: removed %s (%d bytes), left by process %s, which no longer runs",
                parent / name,
                size,
                m[1],
            )
    except OSError as err:
        log.warning("hicache hf3fs: cannot look for stale temporary files in %s: %s", parent, err)
    finally:
        os.close(dfd)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def create_data_file(path: Path, capacity: int, num_slots: int, fallocate: bool) -> None:
    """Create ``path`` atomically (temporary file, then rename) with a new file id."""
    geo = Geometry(capacity, slot_stride(capacity), num_slots, uuid.uuid4().bytes)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        sb = _SB.pack(_SB_MAGIC, 1, HEADER_SIZE, geo.capacity, geo.stride, geo.num_slots, geo.file_id)
        os.pwrite(fd, sb + struct.pack("<I", crc(sb)), 0)
        os.ftruncate(fd, geo.size)
        if fallocate:
            os.posix_fallocate(fd, 0, geo.size)
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()  # e.g. the file system refused the size: leave nothing behind
        raise
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path)
    log.info(
        "hicache hf3fs: created %s (%d slots of %d bytes, %d bytes per page)",
        path,
        num_slots,
        geo.stride,
        capacity,
    )


def read_superblock(fd: int, path: Path) -> Geometry:
    """The geometry of the open data file ``fd``; :class:`BackendIOError` if it is not one."""
    raw = os.pread(fd, _SB.size + 4, 0)
    bad = BackendIOError(
        f"{path} is not a hicache hf3fs slot file (bad or unknown superblock); "
        "delete it or choose another file_path_prefix"
    )
    if len(raw) != _SB.size + 4 or crc(raw[: _SB.size]) != struct.unpack("<I", raw[_SB.size :])[0]:
        raise bad
    magic, version, hdr, cap, stride, slots, file_id = _SB.unpack(raw[: _SB.size])
    if magic != _SB_MAGIC or version != 1 or hdr != HEADER_SIZE or stride < HEADER_SIZE + cap:
        raise bad
    geo = Geometry(cap, stride, slots, file_id)
    if os.fstat(fd).st_size < geo.size:
        raise BackendIOError(f"{path} is shorter than its superblock says; delete it to recreate")
    return geo
