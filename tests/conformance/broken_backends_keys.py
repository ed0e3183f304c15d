"""Examples with their own ``hicache_page_keys``: a correct custom key scheme and broken ones.

``GoodCustomKeys`` names each component ``{ns}.{pool}.{component}.{ranks}.{page_hash}`` where
``ns`` is a digest of everything that makes the data differ (model name and revision, KV dtype,
layout) and ``ranks`` holds every rank AND size (``all`` for rank-replicated pools). Each broken
example changes one part of it. See ``broken_backends.py`` for the registry.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from hicache_core import PoolError, PoolName, check_key, hookimpl
from hicache_core.paging.keys import ValidHashes

from .broken_backends import LOCK, GoodMemory


class GoodCustomKeys(GoodMemory):
    """A correct backend with its own key scheme (it must pass the whole suite)."""

    sep = "."  # between the fields of a key

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        self.ns = self.namespace()

    def namespace(self) -> str:
        """The key prefix of this config: a digest of model, revision, KV dtype and layout."""
        c = self.config
        layout = str(getattr(c.layout, "value", c.layout))
        identity = json.dumps([c.model_name, getattr(c, "model_revision", None), c.kv_dtype, layout])
        return "m" + hashlib.sha256(identity.encode()).hexdigest()[:20]

    def rank_tag(self, replicated: bool) -> str:
        """Every rank and size the data depends on (``all`` for rank-replicated pools)."""
        c = self.config
        tp = "all" if replicated else f"tp{c.tp_rank}of{c.tp_size}"
        return f"{tp}-pp{c.pp_rank}of{c.pp_size}-cp{c.attn_cp_rank}of{c.attn_cp_size}"

    def pool_of(self, pool_name: PoolName) -> Any:
        pool = self.pools.get(PoolName(pool_name))
        if pool is None:
            raise PoolError(
                f"pool {str(pool_name)!r} is not registered; register it (store.register_pool) first"
            )
        return pool

    def page_hashes(self, page_hashes: Sequence[str]) -> Sequence[str]:
        return ValidHashes(page_hashes)  # KeyFormatError for a malformed or unsafe hash

    def component_key(self, pool_name: PoolName, component: str, ranks: str, page_hash: str) -> str:
        return self.sep.join((self.ns, PoolName(pool_name).value, component, ranks, page_hash))

    @hookimpl
    def hicache_page_keys(self, pool_name: PoolName, page_hashes: Sequence[str]) -> list[tuple[str, ...]]:
        pool = self.pool_of(pool_name)
        hashes = self.page_hashes(page_hashes)
        ranks = self.rank_tag(pool.rank_replicated)
        return [tuple(self.component_key(pool_name, c, ranks, h) for c in pool.components) for h in hashes]

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        # The store passes the namespace of its own config: this backend's keys for that config
        # start with `self.ns`. A namespace no config produces is refused.
        check_key(namespace)
        with LOCK:
            gone = [k for k in self.data if k.startswith(self.ns + self.sep)]
            for k in gone:
                del self.data[k]
        return len(gone)


class SlugKeys(GoodCustomKeys):
    """The key namespace is a readable slug of the model name (non-alphanumerics become ``-``),
    without a digest: ``org/model-x`` and ``org-model-x`` share every key.

    Breaks: design.md 4: "Two configs that must not share data can never produce the same key";
    CONTRIBUTING.md 1.4, ``hicache_page_keys``: "override only with care".
    """

    def namespace(self) -> str:
        c = self.config
        slug = re.sub(r"[^A-Za-z0-9]+", "-", c.model_name).strip("-")
        revision = re.sub(r"[^A-Za-z0-9]+", "-", str(getattr(c, "model_revision", None) or "main"))
        layout = str(getattr(c.layout, "value", c.layout))
        return f"{slug}-{revision}-{re.sub(r'[^A-Za-z0-9]+', '-', c.kv_dtype)}-{layout}"


class RankCollide(GoodCustomKeys):
    """The keys leave the TP rank out: MHA ranks, which hold different heads, read each other's
    pages.

    Breaks: design.md 4: "The default keys are namespaced by [...] the tp, pp and attn-cp ranks
    and sizes where the data differs per rank" and "Two configs that must not share data can
    never produce the same key".
    """

    def rank_tag(self, replicated: bool) -> str:
        c = self.config
        return f"pp{c.pp_rank}of{c.pp_size}-cp{c.attn_cp_rank}of{c.attn_cp_size}"


class TpRankOnlyKeys(GoodCustomKeys):
    """The rank part of the key encodes ``tp_rank`` but not ``tp_size``: rank 0 of a TP-2
    deployment and rank 0 of a TP-4 one (which hold different head slices) share keys.

    Breaks: design.md 4: "The default keys are namespaced by [...] the tp, pp and attn-cp ranks and
    sizes where the data differs per rank" and "Two configs that must not share data can never
    produce the same key".
    """

    def rank_tag(self, replicated: bool) -> str:
        c = self.config
        tp = "all" if replicated else f"tp{c.tp_rank}"
        return f"{tp}-pp{c.pp_rank}of{c.pp_size}-cp{c.attn_cp_rank}of{c.attn_cp_size}"


class SlashKeys(GoodCustomKeys):
    """Component keys are built like object-store paths (``ns/pool/component/ranks/hash``).

    Breaks: CONTRIBUTING.md 1.4, ``hicache_page_keys``: "keys file-name safe
    (`hicache_core.check_key`)"; design.md 4: "Keys are safe to use as file names: no separators
    and no `..`".
    """

    sep = "/"


class KeysForAnyPool(GoodCustomKeys):
    """Keys for a pool that was never registered are made up (one ``data`` component) instead
    of raising ``PoolError``.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_page_keys``: "an unregistered pool raises
    `PoolError`".
    """

    def pool_of(self, pool_name: PoolName) -> Any:
        pool = self.pools.get(PoolName(pool_name))
        if pool is None:

            class _Unregistered:
                components = ("data",)
                rank_replicated = False

            return _Unregistered()
        return pool


class KeysWithoutHashCheck(GoodCustomKeys):
    """Page hashes are pasted into keys unchecked (``../etc``, ``a/b`` or a non-str included).

    Breaks: CONTRIBUTING.md 1.4, ``hicache_page_keys``: "a malformed hash `KeyFormatError`".
    """

    def page_hashes(self, page_hashes: Sequence[str]) -> Sequence[str]:
        return [str(h) for h in page_hashes]
