"""Small value types shared by every layer: pool names, policies, capabilities.

This module imports neither torch nor pydantic, so listing backends stays cheap.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from operator import countOf
from typing import TYPE_CHECKING, Any, TypeVar, Union

from .errors import ArgumentTypeError, BackendContractError, BatchShapeError, BatchTypeError, PoolError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "Capabilities",
    "DraftIo",
    "DraftIoMode",
    "HitPolicy",
    "IoOp",
    "Layout",
    "PageKeys",
    "PoolName",
    "PoolTransfer",
]


class _StrEnum(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


_E = TypeVar("_E", bound=_StrEnum)


class PoolName(_StrEnum):
    """Names under which host pools are registered with a store."""

    KV = "kv"
    MAMBA = "mamba"
    INDEXER = "indexer"
    DRAFT = "draft"


class HitPolicy(_StrEnum):
    """How a pool's pages count towards a restorable prefix.

    ``ALL_PAGES``: every page of the prefix must exist (KV, DSA indexer, draft).
    ``TRAILING_PAGES``: only the pages at the end of the prefix are needed (Mamba state).
    """

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


class Layout(_StrEnum):
    """Memory layout of a host pool. Zero-copy I/O needs ``PAGE_FIRST``."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"


class IoOp(_StrEnum):
    """The operation of a batch I/O hook call."""

    EXISTS = "exists"
    GET = "get"
    SET = "set"


class DraftIoMode(_StrEnum):
    """How a backend can store speculative-decoding draft KV pages."""

    ZERO_COPY_V2 = "zero_copy_v2"
    GENERIC = "generic"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class DraftIo:
    """A backend's answer to ``hicache_draft_io_capability``: a mode and why."""

    mode: DraftIoMode
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _member(DraftIoMode, self.mode, "DraftIo: mode"))
        if not isinstance(self.reason, str):
            raise BackendContractError(f"DraftIo: reason must be a str, got {type(self.reason).__name__}")


def _member(enum: type[_E], value: object, what: str) -> _E:
    """``enum(value)``, or :class:`BackendContractError` naming ``what`` and the valid values."""
    try:
        return enum(value)
    except (ValueError, TypeError):
        raise BackendContractError(
            f"{what} must be one of {[m.value for m in enum]}, got {value!r:.80}"
        ) from None


_ALL_POOLS = frozenset(PoolName)


@dataclass(frozen=True)
class Capabilities:
    """What a backend class declares statically (readable without connecting).

    ``v1``/``v2``: which batch I/O hooks it implements. ``zero_copy``: its v2 path reads
    and writes host memory in place (requires ``page_first`` pools). ``pools``: pool names it
    can store. ``persistent``: data survives closing and reopening the store. ``shared``: data
    written by one process is visible to other processes (or hosts) using the same options.
    ``draft_io``: the draft mode under a default config (the hook may narrow it per config).
    ``set_skips_existing``: SET of a key that is already stored keeps the stored object, reports
    it ``True`` and moves no bytes for it (for example a store whose put of an existing key is a
    server-side no-op). ``CacheController.backup`` then sends pages without an existence pass
    first, saving a round trip per batch; ``TransferResult.skipped`` cannot count the pages the
    backend skipped itself. An instance may narrow its class's capabilities for its options
    (a backend option that turns SET into an overwrite must clear this flag).
    """

    v1: bool = True
    v2: bool = False
    zero_copy: bool = False
    pools: frozenset[PoolName] = _ALL_POOLS
    persistent: bool = False
    shared: bool = False
    draft_io: DraftIoMode = DraftIoMode.UNSUPPORTED
    set_skips_existing: bool = False

    def __post_init__(self) -> None:
        for flag in _FLAGS:
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise BackendContractError(f"Capabilities: {flag} must be a bool, got {value!r:.80}")
        pools = self.pools
        try:
            if isinstance(pools, (str, bytes)) or not isinstance(pools, Iterable):
                raise TypeError
            names = list(pools)
        except TypeError:
            raise BackendContractError(
                f"Capabilities: pools must be a collection of pool names, got {type(pools).__name__}"
            ) from None
        object.__setattr__(
            self, "pools", frozenset(_member(PoolName, p, "Capabilities: pools") for p in names)
        )
        object.__setattr__(self, "draft_io", _member(DraftIoMode, self.draft_io, "Capabilities: draft_io"))
        if not (self.v1 or self.v2):
            raise BackendContractError("Capabilities: a backend must declare at least one of v1 or v2")
        if self.zero_copy and not self.v2:
            raise BackendContractError("Capabilities: zero_copy applies to the v2 path; declare v2=True")
        if PoolName.KV not in self.pools:
            raise BackendContractError("Capabilities: every backend must support the 'kv' pool")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (pool names sorted)."""
        return {
            "v1": self.v1,
            "v2": self.v2,
            "zero_copy": self.zero_copy,
            "pools": sorted(p.value for p in self.pools),
            "persistent": self.persistent,
            "shared": self.shared,
            "draft_io": self.draft_io.value,
            "set_skips_existing": self.set_skips_existing,
        }


_FLAGS = ("v1", "v2", "zero_copy", "persistent", "shared", "set_skips_existing")

IndexLike = Union[Sequence[int], "torch.Tensor"]


class PageKeys(tuple[tuple[str, ...], ...]):
    """Per page, the tuple of its component storage keys (``keys[i][c]``: component ``c`` of page
    ``i``): a tuple whose every row is an exact ``tuple``, checked once when built (rows given as
    lists or other sequences are converted). ``Store.page_keys`` returns one, and a
    :class:`PoolTransfer` given one keeps it without checking its rows again."""

    __slots__ = ()

    def __new__(cls, rows: Iterable[Sequence[str]] = ()) -> PageKeys:
        if type(rows) is PageKeys:
            return rows
        out = tuple.__new__(
            cls, rows if type(rows) is list or type(rows) is tuple else _as_tuple(rows, "keys")
        )
        if countOf(map(type, out), tuple) != len(out):
            out = tuple.__new__(cls, [_as_tuple(k, "keys[i]") for k in out])
        return out


@dataclass(frozen=True)
class PoolTransfer:
    """One pool's share of a v2 batch.

    ``host_indices[i]`` is the host page (slot) that holds page ``page_hashes[i]``.
    ``keys[i]`` are that page's component storage keys, resolved by the controller through
    ``hicache_page_keys`` so a backend never has to recompute them. The hit policy tells the
    backend how the controller will interpret existence results; a backend must still answer
    for every page it is given.
    """

    pool: PoolName
    host_indices: tuple[int, ...]
    page_hashes: tuple[str, ...]
    hit_policy: HitPolicy = HitPolicy.ALL_PAGES
    keys: tuple[tuple[str, ...], ...] = field(default=PageKeys())

    def __post_init__(self) -> None:
        if type(self.pool) is not PoolName:
            try:
                object.__setattr__(self, "pool", PoolName(self.pool))
            except (ValueError, TypeError):
                raise PoolError(
                    f"PoolTransfer: unknown pool {self.pool!r:.80}; known pools: {[p.value for p in PoolName]}"
                ) from None
        if type(self.hit_policy) is not HitPolicy:
            try:
                object.__setattr__(self, "hit_policy", HitPolicy(self.hit_policy))
            except (ValueError, TypeError):
                raise BatchShapeError(
                    f"PoolTransfer: hit_policy must be one of {[h.value for h in HitPolicy]}, "
                    f"got {self.hit_policy!r:.80}"
                ) from None
        indices = self.host_indices
        if type(indices) is not tuple or countOf(map(type, indices), int) != len(indices):
            object.__setattr__(self, "host_indices", _as_int_tuple(indices))
        if type(self.page_hashes) is not tuple:
            object.__setattr__(self, "page_hashes", _as_tuple(self.page_hashes, "page_hashes"))
        if type(self.keys) is not PageKeys:
            object.__setattr__(self, "keys", PageKeys(self.keys))
        n = len(self.page_hashes)
        if len(self.host_indices) != n:
            raise BatchShapeError(
                f"PoolTransfer({self.pool.value}): {len(self.host_indices)} host indices for "
                f"{n} page hashes; pass exactly one host page index per page hash"
            )
        if self.keys and len(self.keys) != n:
            raise BatchShapeError(
                f"PoolTransfer({self.pool.value}): {len(self.keys)} key tuples for {n} pages"
            )

    def __len__(self) -> int:
        return len(self.page_hashes)


def _as_tuple(values: object, what: str) -> tuple[Any, ...]:
    """``tuple(values)`` for a sequence; :class:`ArgumentTypeError` naming ``what`` otherwise (a
    single string, or something that is not iterable)."""
    if type(values) is tuple or type(values) is list:
        return tuple(values)
    if not isinstance(values, (str, bytes)) and isinstance(values, Iterable):
        try:
            return tuple(values)
        except TypeError:  # e.g. iterating a 0-d tensor
            pass
    raise ArgumentTypeError(f"PoolTransfer: {what} must be a sequence, got {type(values).__name__}")


def _as_int_tuple(values: Iterable[int] | Any) -> tuple[int, ...]:
    """Host indices as a tuple of ints (a tensor's ``tolist()``); a non-integer index (a float, a
    bool, a string) is a :class:`BatchShapeError`, never silently truncated to another page."""
    tolist = getattr(values, "tolist", None)
    try:
        if tolist is None and isinstance(values, (str, bytes, bytearray, set, frozenset, dict)):
            raise TypeError  # characters, byte values, no order, keys: not page indices
        out = tuple(tolist() if tolist is not None else values)
        if countOf(map(type, out), int) != len(out):
            out = tuple(map(_index, out))
    except (TypeError, ValueError):
        raise BatchTypeError(
            f"PoolTransfer: host_indices must be a sequence of int host page indices (or an integer "
            f"tensor), got {values!r:.80}"
        ) from None
    return out


def _index(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a host page index")
    return operator.index(value)  # type: ignore[arg-type]
