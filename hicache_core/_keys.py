"""The default page-key scheme and key safety checks.

A component key is five dot-separated fields::

    {namespace}.{pool}.{component}.{ranks}.{page_hash}

* ``namespace``: ``{model-slug}-{kv_dtype}-{layout}-{digest}``; the digest covers the exact
  model name, KV dtype and layout, so configs that must not share data never share keys even
  when their readable slugs coincide;
* ``pool`` and ``component``: ``kv.k``, ``kv.v``, ``mamba.conv_0``, ``draft.k``... (draft pages
  live in their own key space);
* ``ranks``: ``tp{r}of{n}`` for per-rank data, ``all`` for rank-replicated data (MLA KV, DSA
  indexer), each followed by ``-pp{r}of{n}`` / ``-cp{r}of{n}`` when those are > 1;
* ``page_hash``: the engine's page hash, unchanged.

Keys contain only ``[A-Za-z0-9._-]``, never ``..``, and are at most 255 bytes, so they are
safe as file names on every backend.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from ._batch import NATIVE
from ._errors import KeyFormatError, PoolError
from ._types import PoolName
from .hookspecs import hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from ._pools import HostPool

__all__ = [
    "DefaultPageKeys",
    "KeyScheme",
    "ValidHashes",
    "check_key",
    "check_keys",
    "check_page_hash",
    "check_page_hashes",
]

MAX_HASH_LEN = 128
MAX_KEY_LEN = 255
_HASH_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SLUG_RE = re.compile(r"[^A-Za-z0-9_-]+")
_HASHES_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}(?:\n[A-Za-z0-9][A-Za-z0-9_-]{0,127})*")


_HASH_BYTES = bytes(c for c in range(128) if chr(c).isalnum() or chr(c) in "_-")  # [A-Za-z0-9_-]


def check_page_hashes(page_hashes: Sequence[str]) -> None:
    """Validate many page hashes at C speed; raise like check_page_hash.

    A :class:`ValidHashes` passed validation when it was built and is accepted as is.
    """
    if type(page_hashes) is not ValidHashes:
        _check_all(page_hashes)


def _check_all(page_hashes: Sequence[str]) -> None:
    if not page_hashes or (NATIVE is not None and NATIVE.valid_hashes(page_hashes)):
        return
    try:
        joined = "\n".join(page_hashes)
    except TypeError:
        joined = ""
    n = len(page_hashes)
    if _uniform_valid(joined, n):
        return
    if joined.count("\n") != n - 1 or not _HASHES_RE.fullmatch(joined):
        for h in page_hashes:
            check_page_hash(h)


def _uniform_valid(joined: str, n: int) -> bool:
    """True if ``joined`` (``"\\n".join`` of ``n`` hashes) is ``n`` valid page hashes of one length.

    A fast path for the usual batch (digests of one length); ``False`` only means "not shown
    here", and the caller falls back to the exact check.
    """
    size = joined.find("\n") if n > 1 else len(joined)
    if not 0 < size <= MAX_HASH_LEN or len(joined) != n * (size + 1) - 1 or not joined.isascii():
        return False
    raw = joined.encode("ascii")
    seps = b"\n" * (n - 1)
    # Besides [A-Za-z0-9_-] only n - 1 newlines, and they sit every size + 1 characters: they are
    # the separators, so every hash has `size` allowed characters; each starts with [A-Za-z0-9].
    return (
        raw.translate(None, _HASH_BYTES) == seps
        and raw[size :: size + 1] == seps
        and raw[:: size + 1].isalnum()
    )


def _snapshot(page_hashes: Sequence[str]) -> Sequence[str]:
    """``page_hashes`` itself if its iteration is the built-in one, else a tuple of one pass.

    Keys are built from exactly what was validated: a subclass (or any other sequence) could
    yield other items on the pass after the check.
    """
    return page_hashes if type(page_hashes) in _PLAIN_SEQUENCES else tuple(page_hashes)


class ValidHashes(tuple[str, ...]):
    """Page hashes that passed :func:`check_page_hashes`: building one validates them.

    A tuple, so its elements cannot change after validation; :func:`check_page_hashes` (and
    so the default ``hicache_page_keys``) accepts an exact ``ValidHashes`` without checking it
    again. Any other sequence, subclasses included, is checked in full.
    """

    __slots__ = ()

    def __new__(cls, page_hashes: Iterable[str] = ()) -> ValidHashes:
        # An immutable copy is what gets checked and kept (an exact tuple is immutable already).
        items = page_hashes if type(page_hashes) is tuple else tuple(page_hashes)
        if NATIVE is None or not NATIVE.valid_hashes(items):  # one C pass for the usual batch
            _check_all(items)
        return tuple.__new__(cls, items)

    def pick(self, positions: Iterable[int]) -> ValidHashes:
        """The hashes at ``positions``, in that order (taken from valid hashes: not checked again)."""
        picked = map(self.__getitem__, positions)
        if type(self) is ValidHashes:
            return tuple.__new__(ValidHashes, picked)
        return ValidHashes(picked)  # a subclass may redefine item access: check


class _KeyConfig(Protocol):
    """What the key scheme reads from a config (``StorageConfig`` satisfies it)."""

    @property
    def model_name(self) -> str: ...

    @property
    def kv_dtype(self) -> str: ...

    @property
    def layout(self) -> object: ...

    @property
    def tp_rank(self) -> int: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def pp_rank(self) -> int: ...

    @property
    def pp_size(self) -> int: ...

    @property
    def attn_cp_rank(self) -> int: ...

    @property
    def attn_cp_size(self) -> int: ...


def check_page_hash(page_hash: object) -> str:
    """Return ``page_hash`` if it is a safe page hash, else raise :class:`KeyFormatError`."""
    if not isinstance(page_hash, str):
        raise KeyFormatError(
            f"page hash must be a str (hex digest from hicache_core.page_hashes), got {type(page_hash).__name__}"
        )
    if not (0 < len(page_hash) <= MAX_HASH_LEN) or not _HASH_RE.fullmatch(page_hash):
        raise KeyFormatError(
            f"invalid page hash {page_hash[:80]!r}: use 1-{MAX_HASH_LEN} characters from "
            "[A-Za-z0-9_-] (for example a sha256 hex digest from hicache_core.page_hashes)"
        )
    return page_hash


def check_key(key: object) -> str:
    """Return ``key`` if it is safe as a storage key / file name, else raise :class:`KeyFormatError`."""
    if not isinstance(key, str):
        raise KeyFormatError(f"storage key must be a str, got {type(key).__name__}")
    if not (0 < len(key) <= MAX_KEY_LEN) or not _KEY_RE.fullmatch(key) or ".." in key:
        raise KeyFormatError(
            f"unsafe storage key {key[:80]!r}: keys are 1-{MAX_KEY_LEN} characters from "
            "[A-Za-z0-9._-], start with a letter or digit and never contain '..' or a path separator"
        )
    return key


def check_keys(keys: Sequence[str]) -> None:
    """Check every key like :func:`check_key`; raise :class:`KeyFormatError` for the first bad one.

    For a backend that validates the keys of a whole batch: a list or tuple of valid ``str``
    keys (the usual batch) is checked in one C pass when the ``hicache_core._batchops``
    extension is built, about 5x faster than calling :func:`check_key` per key.
    """
    if NATIVE is not None and NATIVE.valid_keys(keys):
        return
    for key in keys:
        check_key(key)


class KeyScheme:
    """Builds component keys for one store configuration (see the module docstring)."""

    def __init__(self, config: _KeyConfig) -> None:
        layout = str(getattr(config.layout, "value", config.layout))
        identity = "\0".join((config.model_name, config.kv_dtype, layout))
        digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        slug = _SLUG_RE.sub("-", config.model_name).strip("-_")[:48] or "model"
        dtype = _SLUG_RE.sub("-", config.kv_dtype)[:16] or "dtype"
        self.namespace = f"{slug}-{dtype}-{layout}-{digest}"
        extra = ""
        if config.pp_size > 1:
            extra += f"-pp{config.pp_rank}of{config.pp_size}"
        if config.attn_cp_size > 1:
            extra += f"-cp{config.attn_cp_rank}of{config.attn_cp_size}"
        self.rank_tag = f"tp{config.tp_rank}of{config.tp_size}{extra}"
        self.replicated_tag = f"all{extra}"

    def prefixes(self, pool_name: PoolName, components: Sequence[str], replicated: bool) -> list[str]:
        """The key prefix (everything but the page hash) of each component."""
        ranks = self.replicated_tag if replicated else self.rank_tag
        return [f"{self.namespace}.{PoolName(pool_name).value}.{c}.{ranks}." for c in components]

    def keys(
        self, pool_name: PoolName, components: Sequence[str], replicated: bool, page_hashes: Sequence[str]
    ) -> list[tuple[str, ...]]:
        prefixes = self.prefixes(pool_name, components, replicated)
        items = _snapshot(page_hashes)
        check_page_hashes(items)
        return [tuple(p + h for p in prefixes) for h in items]


class DefaultPageKeys:
    """The core's ``hicache_page_keys`` implementation (registered ``trylast`` in every store)."""

    def __init__(self, config: _KeyConfig) -> None:
        self.scheme = KeyScheme(config)
        self._pools: dict[PoolName, tuple[tuple[str, ...], bool]] = {}

    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> None:
        name = PoolName(pool_name)
        self._pools[name] = (
            tuple(self.scheme.prefixes(name, pool.components, pool.rank_replicated)),
            pool.rank_replicated,
        )

    @hookimpl(trylast=True)
    def hicache_page_keys(self, pool_name: PoolName, page_hashes: Sequence[str]) -> list[tuple[str, ...]]:
        try:
            prefixes, _ = self._pools[pool_name]
        except KeyError:
            raise PoolError(
                f"pool {str(pool_name)!r} is not registered with this store; registered pools: "
                f"{[p.value for p in self._pools]}. Attach it through CacheController (or "
                "store.register_pool) before doing I/O on it"
            ) from None
        if type(page_hashes) is ValidHashes:  # checked when built: the controller's batches
            items: Sequence[str] = page_hashes
        else:
            items = _snapshot(page_hashes)
            check_page_hashes(items)
        if NATIVE is not None:
            keys = NATIVE.page_keys(prefixes, items)
            if keys is not None:
                return keys
        if len(prefixes) == 1:
            p0 = prefixes[0]
            return [(p0 + h,) for h in items]
        if len(prefixes) == 2:  # MHA k/v
            p0, p1 = prefixes
            return [(p0 + h, p1 + h) for h in items]
        return list(zip(*[[p + h for h in items] for p in prefixes]))


_PLAIN_SEQUENCES = (list, tuple, ValidHashes)
