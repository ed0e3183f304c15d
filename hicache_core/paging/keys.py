"""The default page-key scheme and key safety checks.

A component key is five dot-separated fields::

    {namespace}.{pool}.{component}.{ranks}.{page_hash}

* ``namespace``: ``{model-slug}-{kv_dtype}-{layout}-{digest}``; the digest covers the exact
  model name, KV dtype and layout (and the model revision when the config sets one), so
  configs that must not share data never share keys even when their readable slugs coincide;
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
import json
import re
from collections.abc import Iterable, Sequence
from operator import countOf, itemgetter
from typing import Protocol

from ..errors import KeyFormatError, KeyTypeError
from ..types import PoolName

__all__ = [
    "MAX_HASH_LEN",
    "MAX_KEY_LEN",
    "KeyScheme",
    "ValidHashes",
    "check_key",
    "check_keys",
    "check_page_hash",
]

MAX_HASH_LEN = 128
MAX_KEY_LEN = 255
_HASH_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_SLUG_RE = re.compile(r"[^A-Za-z0-9_-]+")
# The characters of a page hash / of a key.
_HASH_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
_KEY_BYTES = _HASH_BYTES + b"."
_DOTS = re.compile(r"\.\.")
_first = itemgetter(0)


def check_page_hash(page_hash: object) -> str:
    """Return ``page_hash`` if it is a safe page hash, else raise :class:`KeyFormatError`.

    A page hash is an exact ``str`` (not a subclass, whose ``__str__`` or ``__fspath__`` could
    say something else) of 1-128 characters from ``[A-Za-z0-9_-]``, starting with a letter or
    digit.
    """
    if type(page_hash) is not str:
        raise KeyTypeError(
            "page hash must be a str (a hex digest from hicache_core.page_hashes), got "
            f"{type(page_hash).__name__}"
        )
    if not _HASH_RE.fullmatch(page_hash):
        raise KeyFormatError(
            f"invalid page hash {page_hash[:80]!r}: use 1-{MAX_HASH_LEN} characters from "
            "[A-Za-z0-9_-] (for example a sha256 hex digest from hicache_core.page_hashes)"
        )
    return page_hash


def check_key(key: object) -> str:
    """Return ``key`` if it is safe as a storage key / file name, else raise :class:`KeyFormatError`.

    A key is an exact ``str`` of 1-255 characters from ``[A-Za-z0-9._-]`` that starts with a
    letter or digit and never contains ``..``: no path separator, no NUL, no parent reference.
    """
    if type(key) is not str:
        raise KeyTypeError(f"storage key must be a str, got {type(key).__name__}")
    if not _KEY_RE.fullmatch(key) or ".." in key:
        raise KeyFormatError(
            f"unsafe storage key {key[:80]!r}: keys are 1-{MAX_KEY_LEN} characters from "
            "[A-Za-z0-9._-], start with a letter or digit and never contain '..' or a path separator"
        )
    return key


def _all_valid(items: Sequence[object], max_len: int, chars: bytes) -> bool:
    """True if every item is an exact ``str`` of 1-``max_len`` characters from ``chars`` that
    starts with a letter or digit and holds no ``..``: the rules of :func:`check_page_hash` and
    :func:`check_key`, checked for the whole batch in a few C-level passes over it. False may
    also mean "check each item" (a ``..`` that only appears where two items meet)."""
    n = len(items)
    if n == 0:
        return True
    if countOf(map(type, items), str) != n:
        return False
    strs: Sequence[str] = items  # type: ignore[assignment]
    # Usually every item has the first one's length (hex digests, the keys built from them):
    # one comparison per item, where a set of the lengths hashes each of them.
    size = len(strs[0])
    if countOf(map(len, strs), size) != n:
        size = 0
        lengths = set(map(len, strs))
        if min(lengths) < 1 or max(lengths) > max_len:
            return False
    elif size < 1 or size > max_len:
        return False
    joined = "".join(strs)
    if not joined.isascii() or joined.encode("ascii").translate(None, chars):
        return False  # a character outside the set
    # Each item's first character: with one common length they sit at every size-th place of
    # the joined string (one slice), otherwise they are picked item by item.
    firsts = joined[::size] if size else "".join(map(_first, strs))
    return firsts.isalnum() and (b"." not in chars or _DOTS.search(joined) is None)


def check_keys(keys: Sequence[str]) -> None:
    """Check every key like :func:`check_key`; raise :class:`KeyFormatError` for the first bad one.

    For a backend that validates the keys of a whole batch at its I/O boundary.
    """
    if type(keys) is not list and type(keys) is not tuple:  # (an ABC check is a Python call)
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            raise KeyTypeError(f"keys must be a sequence of key strings, got {type(keys).__name__}")
    keys = tuple(keys)
    if not keys or _all_valid(keys, MAX_KEY_LEN, _KEY_BYTES):
        return
    for key in keys:
        check_key(key)


class ValidHashes(tuple[str, ...]):
    """An immutable batch of page hashes, each checked by :func:`check_page_hash` when built.

    The controller builds one per request, so the key hook does not check the batch again.
    """

    __slots__ = ()

    def __new__(cls, page_hashes: Iterable[str] = ()) -> ValidHashes:
        if type(page_hashes) is ValidHashes:
            return page_hashes
        if isinstance(page_hashes, (str, bytes)):
            raise KeyTypeError("page_hashes must be a sequence of hash strings, not a single string")
        items = tuple.__new__(cls, page_hashes)  # the batch itself: checked, then returned
        if not _all_valid(items, MAX_HASH_LEN, _HASH_BYTES):
            for h in items:
                check_page_hash(h)
        return items

    def pick(self, positions: Iterable[int]) -> ValidHashes:
        """The hashes at ``positions``, in that order (already valid: not checked again)."""
        if (
            type(positions) is range
            and positions.step == 1
            and 0 <= positions.start <= positions.stop <= len(self)
        ):
            return tuple.__new__(ValidHashes, self[positions.start : positions.stop])  # a run: one slice
        return tuple.__new__(ValidHashes, map(self.__getitem__, positions))


class _KeyConfig(Protocol):
    """What the key scheme reads from a config (``StorageConfig`` satisfies it)."""

    @property
    def model_name(self) -> str: ...

    @property
    def kv_dtype(self) -> str: ...

    # ``model_revision`` (str or None) is read with getattr: a config without it has none.

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


class KeyScheme:
    """Builds component keys for one store configuration (see the module docstring)."""

    def __init__(self, config: _KeyConfig) -> None:
        layout = str(getattr(config.layout, "value", config.layout))
        revision = getattr(config, "model_revision", None)
        fields = (config.model_name, config.kv_dtype, layout)
        if revision is None and "\0" not in "".join(fields):
            # The original identity: every namespace without a revision keeps its exact keys.
            identity = "\0".join(fields)
        else:
            # JSON never holds a raw NUL, the form above always holds exactly two, so the two
            # forms never collide, and JSON is unambiguous whatever the fields contain (a field
            # with a NUL, which StorageConfig refuses, lands here too).
            identity = json.dumps(["revision/1", *fields, None if revision is None else str(revision)])
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
        return [tuple(p + h for p in prefixes) for h in ValidHashes(page_hashes)]
