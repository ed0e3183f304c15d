"""``hf3fs``: a v1 backend modelled on 3FS usrbio, over a local preallocated file per rank.

SGLang's HF3FS backend gives each rank one preallocated file ``{file_path_prefix}.{rank}.bin``
on 3FS and asks a metadata service which page slot of that file holds a key. This backend does
the same against the local file system (the role SGLang's mock client plays), with the
metadata kept next to the file in a crash-safe index log (see :mod:`._slotfile`).

* **Files.** Per-rank data goes to ``{prefix}.{rank}.bin`` where ``rank`` is the TP rank,
  suffixed ``-pp{r}`` / ``-cp{r}`` when pipeline / attention-context parallelism is on.
  Rank-replicated data -- the keys whose rank field is ``all...``, which is how the core's key
  scheme marks MLA KV and the DSA indexer -- goes to rank 0's file of the same PP/CP group, so
  every MLA rank reads the one copy that rank 0 writes.
* **Slot size.** ``bytes_per_page`` (the payload capacity of a slot) is fixed when a file is
  created: the ``bytes_per_page`` option if set, otherwise the *largest component page* over
  the pools registered so far (``max(pool.component_nbytes)``; a component -- K, V, MLA KV,
  Mamba temporal, conv_i, indexer -- is one stored object). A later component larger than the
  slot (for example a pool registered after the file exists) fails with ``False`` and an error
  log naming the sizes; an existing file keeps its geometry across restarts.
* **Capacity.** ``num_slots`` slots, or as many as fit in ``file_size``. When full, the least
  recently used slot is reused.
* **Crash safety, sharing.** See :mod:`._slotfile`: a crash mid-write gives a miss, never wrong
  bytes; writers serialise with ``flock`` and readers tail the index log, so several processes
  (MLA ranks, a restarted server) can share the files.
* **Integrity.** A slot that fails its header or payload CRC check on a read (not a
  concurrent overwrite) is released, logged (WARNING, naming the key) and counted in
  :attr:`Hf3fsBackend.integrity_errors`, which the core's ``metrics`` extension reports; the
  page is a miss and the next backup rewrites it. A damaged index record costs its page only
  (each record is checked on its own, :mod:`._indexlog`) and is counted the same way.
* **Keys.** Every key given to ``hicache_batch_io_v1`` (and the namespace of
  ``hicache_clear``) is checked with :func:`hicache_core.check_keys` -- an exact ``str`` from
  ``[A-Za-z0-9._-]`` without ``..`` -- before any file is touched: a bad key fails the whole
  call with :class:`~hicache_core.KeyFormatError` and nothing is written.
* **Options** are strict: integers only (no bools, floats or strings), within the limits of
  the on-disk format (``MAX_FILE_SIZE``, ``MAX_SLOTS``, ``MAX_BYTES_PER_PAGE``); a bad value is
  refused when the store opens, naming the field.
* **Draft KV** is not offloaded (``unsupported``): slots are sized for the target pages.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hicache_core import (
    BackendIOError,
    BatchShapeError,
    Capabilities,
    DraftIo,
    DraftIoMode,
    IoOp,
    KeyFormatError,
    KeyScheme,
    OptionsError,
    PoolError,
    PoolName,
    check_key,
    check_keys,
    hookimpl,
)
from hicache_core.config import expand_path

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from hicache_core import HostPool, StorageConfig

    from ._slotfile import SlotFile

__all__ = [
    "DRAFT_REASON",
    "MAX_BYTES_PER_PAGE",
    "MAX_FILE_SIZE",
    "MAX_SLOTS",
    "Hf3fsBackend",
    "default_prefix",
]

log = logging.getLogger("hicache.hf3fs")

DRAFT_REASON = (
    "hf3fs page slots are sized for the target KV pages (bytes_per_page is fixed from the "
    "registered target pools when the file is created), not for the draft pool"
)


MAX_FILE_SIZE = 1 << 56
"""Largest ``file_size`` (64 PiB; file offsets must fit the OS's signed 64-bit ``off_t``)."""
MAX_SLOTS = (1 << 32) - 1
"""Most slots per file (index records store a slot number in 32 bits)."""
MAX_BYTES_PER_PAGE = 1 << 30
"""Largest ``bytes_per_page`` (1 GiB; each open file keeps a read buffer of one slot)."""


def default_prefix() -> str:
    """``{user cache dir}/hicache/hf3fs/hicache`` -- files are ``hicache.{rank}.bin`` in it."""
    from platformdirs import user_cache_dir

    return str(Path(user_cache_dir("hicache")) / "hf3fs" / "hicache")


def _rank_tag(tp_rank: int, config: StorageConfig) -> str:
    tag = str(tp_rank)
    if config.pp_size > 1:
        tag += f"-pp{config.pp_rank}"
    if config.attn_cp_size > 1:
        tag += f"-cp{config.attn_cp_rank}"
    return tag


def _is_replicated(key: str) -> bool:
    parts = key.split(".")
    return len(parts) == 5 and parts[3].startswith("all")


def _raw(buf: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    import ctypes  # here, not at the top: listing backends imports this module

    n = buf.numel() * buf.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(buf.data_ptr())).cast("B")


class Hf3fsBackend:
    """3FS-usrbio-style v1 backend: one preallocated slot file per rank (module docstring)."""

    class Options(BaseModel):
        """Options of the ``hf3fs`` backend."""

        model_config = ConfigDict(extra="forbid", defer_build=True, strict=True, allow_inf_nan=False)

        file_path_prefix: str | None = Field(
            None,
            min_length=1,
            max_length=4000,
            description="files are {file_path_prefix}.{rank}.bin; default {user cache dir}/hicache/hf3fs/hicache",
        )
        file_size: int = Field(
            16 << 30,
            ge=1 << 16,
            le=MAX_FILE_SIZE,
            description="bytes per rank file (sparse unless fallocate)",
        )
        num_slots: int | None = Field(
            None, ge=1, le=MAX_SLOTS, description="page slots per file; overrides file_size"
        )
        bytes_per_page: int | None = Field(
            None,
            ge=1,
            le=MAX_BYTES_PER_PAGE,
            description="slot payload capacity; default: largest registered component page",
        )
        fsync: bool = Field(False, description="fsync data and index before acknowledging a set")
        fallocate: bool = Field(False, description="reserve the file's blocks up front (posix_fallocate)")

        @field_validator("file_path_prefix")
        @classmethod
        def _expand(cls, value: str | None) -> str | None:
            return None if value is None else expand_path(value, "file_path_prefix")

        @model_validator(mode="after")
        def _fits(self) -> Hf3fsBackend.Options:
            if self.bytes_per_page is not None and self.num_slots is None:
                _slots_in(self.file_size, self.bytes_per_page)  # fail now, not at the first write
            return self

    capabilities = Capabilities(
        v1=True,
        v2=False,
        zero_copy=False,
        pools=frozenset({PoolName.KV, PoolName.MAMBA, PoolName.INDEXER}),
        persistent=True,
        shared=True,
        draft_io=DraftIoMode.UNSUPPORTED,
    )

    def __init__(self, config: StorageConfig, options: Hf3fsBackend.Options) -> None:
        self.config = config
        self.options = options
        self.prefix = Path(options.file_path_prefix or default_prefix()).expanduser()
        self.own_tag = _rank_tag(config.tp_rank, config)
        self.shared_tag = _rank_tag(0, config)
        scheme = KeyScheme(config)
        self._rank_fields = {scheme.rank_tag, scheme.replicated_tag}
        self._component_bytes: dict[PoolName, int] = {}
        self._files: dict[str, SlotFile] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._closed_integrity_errors = 0  # counted by files already closed

    @property
    def integrity_errors(self) -> int:
        """Pages found corrupt by this store (released, logged and reported as misses)."""
        with self._lock:
            return self._closed_integrity_errors + sum(f.integrity_errors for f in self._files.values())

    # ----------------------------------------------------------------- files
    def path_for(self, tag: str) -> Path:
        """The data file of rank tag ``tag`` (``{prefix}.{tag}.bin``)."""
        return Path(f"{self.prefix}.{tag}.bin")

    @property
    def bytes_per_page(self) -> int | None:
        """Slot payload size for new files: the option, else the largest registered component page."""
        if self.options.bytes_per_page is not None:
            return self.options.bytes_per_page
        return max(self._component_bytes.values(), default=None)

    def _file(self, tag: str, create: bool) -> SlotFile | None:
        with self._lock:
            if self._closed:
                raise BackendIOError("the hf3fs store is closed; open a new one")
            f = self._files.get(tag)
            if f is not None:
                return f
            path = self.path_for(tag)
            if not path.exists() and not create:
                return None
            capacity = self.bytes_per_page
            if capacity is None and not path.exists():
                raise PoolError(
                    "hf3fs sizes its page slots from the registered pools; register a pool first "
                    "(CacheController does) or set options.bytes_per_page"
                )
            num_slots = self.options.num_slots
            if capacity is not None and num_slots is None:
                try:
                    num_slots = _slots_in(self.options.file_size, capacity)
                except ValueError as err:
                    raise OptionsError(f"hf3fs: {err}") from None
            from ._slotfile import SlotFile  # the slot-file modules load when a file is opened

            try:
                f = SlotFile(
                    path,
                    capacity=capacity,
                    num_slots=num_slots,
                    fsync=self.options.fsync,
                    fallocate=self.options.fallocate,
                    create=create,
                )
            except FileNotFoundError:
                return None
            except OSError as err:
                if isinstance(err, BackendIOError):
                    raise
                raise BackendIOError(f"hf3fs: cannot open {path}: {err}") from err
            if capacity is not None and f.capacity != capacity:
                log.warning(
                    "hicache hf3fs: %s exists with %d-byte slots (registered pools need %d); keeping "
                    "its geometry -- delete the files or use another file_path_prefix to change it",
                    path,
                    f.capacity,
                    capacity,
                )
            self._files[tag] = f
            return f

    def _groups(self, keys: Sequence[str]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            tag = self.shared_tag if _is_replicated(key) else self.own_tag
            groups.setdefault(tag, []).append(i)
        return groups

    # ----------------------------------------------------------------- hooks
    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> None:
        """Record the pool's largest component page; it sizes the slots of files created later."""
        name = PoolName(pool_name)
        if name not in self.capabilities.pools:
            raise PoolError(
                f"hf3fs stores pools {sorted(p.value for p in self.capabilities.pools)}, not {name.value!r}"
            )
        self._component_bytes[name] = max(pool.component_nbytes)

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        """Always ``unsupported``: page slots are sized for the target KV pages."""
        return DraftIo(DraftIoMode.UNSUPPORTED, DRAFT_REASON)

    @hookimpl
    def hicache_batch_io_v1(
        self,
        op: IoOp,
        keys: Sequence[str],
        buffers: Sequence[torch.Tensor] | None,
        pool_name: PoolName | None = None,  # unused (pluggy does not pass it): for direct calls
    ) -> list[bool]:
        """Exists / get / set, one object (page component) per key, one slot per object.

        The keys are checked (:func:`hicache_core.check_keys`) before any file is touched: one
        bad key fails the call with :class:`~hicache_core.KeyFormatError`, nothing is written.
        """
        op = _io_op(op)
        keys = _key_batch(keys)
        if buffers is not None:
            buffers = list(buffers)  # index the same objects that are checked
        if op is not IoOp.EXISTS and (buffers is None or len(buffers) != len(keys)):
            raise BatchShapeError(
                f"hf3fs {op.value}: {len(keys)} keys but "
                f"{'no' if buffers is None else len(buffers)} buffers; pass one buffer per key"
            )
        if not keys:
            return []
        out = [False] * len(keys)
        for tag, idx in self._groups(keys).items():
            f = self._file(tag, create=op is IoOp.SET)
            if f is None:
                continue  # nothing was ever written for this rank: all misses
            sub = [keys[i] for i in idx]
            if op is IoOp.EXISTS:
                flags = f.exists(sub)
            elif op is IoOp.GET:
                assert buffers is not None
                flags = self._get(f, sub, [buffers[i] for i in idx])
            else:
                assert buffers is not None
                flags = self._set(f, sub, [buffers[i] for i in idx])
            for i, ok in zip(idx, flags):
                out[i] = ok
        return out

    def _get(self, f: SlotFile, keys: list[str], buffers: list[torch.Tensor]) -> list[bool]:
        for b in buffers:
            _check_buffer(b)

        def deliver(i: int, payload: memoryview) -> None:
            buf = buffers[i]
            if buf.is_contiguous():
                _raw(buf)[:] = payload
            else:
                import torch

                src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                buf.copy_(src.view(buf.shape))

        return f.get([(k, b.numel()) for k, b in zip(keys, buffers)], deliver)

    def _set(self, f: SlotFile, keys: list[str], buffers: list[torch.Tensor]) -> list[bool]:
        items: list[tuple[str, memoryview]] = []
        keep: list[Any] = []
        too_big: list[int] = []
        for key, buf in zip(keys, buffers):
            _check_buffer(buf)
            if buf.numel() > f.capacity:
                too_big.append(buf.numel())
            src = buf if buf.is_contiguous() else buf.contiguous()
            keep.append(src)  # keep copies alive while their bytes are written
            items.append((key, _raw(src)))
        if too_big:
            log.error(
                "hicache hf3fs: %d object(s) of up to %d bytes exceed the %d-byte page slots of %s; "
                "they are not stored (the file was created for smaller pages: delete it or use "
                "another file_path_prefix so bytes_per_page is derived from all registered pools)",
                len(too_big),
                max(too_big),
                f.capacity,
                f.path,
            )
        return f.put(items)

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        """Release this rank's (and the replicated) slots of ``namespace``; other ranks keep theirs."""
        prefix = check_key(namespace) + "."

        def mine(key: str) -> bool:
            if not key.startswith(prefix):
                return False
            parts = key.split(".")
            return len(parts) != 5 or parts[3] in self._rank_fields

        removed = 0
        for tag in dict.fromkeys((self.own_tag, self.shared_tag)):
            f = self._file(tag, create=False)
            if f is not None:
                removed += f.remove(mine)
        return removed

    @hookimpl
    def hicache_close(self) -> None:
        """Close the files (the data stays for the next open)."""
        with self._lock:
            self._closed = True
            files, self._files = list(self._files.values()), {}
            self._closed_integrity_errors += sum(f.integrity_errors for f in files)
        for f in files:
            f.close()


def _slots_in(file_size: int, capacity: int) -> int:
    """Slots of ``capacity`` payload bytes that fit in ``file_size``; ValueError naming the options."""
    from ._slotfile import SUPERBLOCK_SIZE, slot_stride

    stride = slot_stride(capacity)
    n = (file_size - SUPERBLOCK_SIZE) // stride
    if n < 1:
        raise ValueError(
            f"file_size={file_size} cannot hold one slot of {stride} bytes (bytes_per_page={capacity}); "
            "raise file_size or set num_slots"
        )
    if n > MAX_SLOTS:
        raise ValueError(
            f"file_size={file_size} holds {n} slots of {stride} bytes, more than MAX_SLOTS={MAX_SLOTS}; "
            "lower file_size or set num_slots"
        )
    return n


def _io_op(op: object) -> IoOp:
    try:
        return IoOp(op)
    except (ValueError, TypeError):
        raise BatchShapeError(f"hf3fs: unknown I/O op {op!r}; use one of {[o.value for o in IoOp]}") from None


def _key_batch(keys: object) -> tuple[str, ...]:
    """``keys`` as a tuple, every one checked by :func:`hicache_core.check_keys`."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Iterable):
        raise KeyFormatError(f"hf3fs: keys must be a sequence of str keys, got {type(keys).__name__}")
    batch = tuple(keys)  # a snapshot: the keys checked are the keys used
    check_keys(batch)
    return batch


def _check_buffer(buf: torch.Tensor) -> None:
    if buf.element_size() != 1 or buf.device.type != "cpu":
        raise BatchShapeError(
            f"hf3fs buffers must be torch.uint8 CPU tensors (page-component views), got "
            f"{buf.dtype} on {buf.device}"
        )
