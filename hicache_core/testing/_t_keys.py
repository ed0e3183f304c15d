"""Keys: hostile keys sent straight to the I/O hooks (group ``errors``) and the distinctness of a
custom key scheme (group ``isolation``).

``test_errors_hostile_keys`` bypasses the store and the controller: it calls
``store.pm.hook.hicache_batch_io_v1`` / ``_v2`` itself with keys no key scheme produces (path
separators, ``..``, an absolute path, NUL, 4 KiB, non-ASCII, a ``str`` subclass whose ``__str__``
and ``__fspath__`` name a path outside). Each call must raise a typed ``hicache_core.HiCacheError``
or answer ``False`` for the key, and nothing may appear or change outside the backend's storage:
the test gives every path option (``tmp_dir_options``) a fresh place deep inside a directory of its
own, puts decoy files around it (where the ``..`` keys point), and compares that directory before
and after.

``test_isolation_custom_keys`` runs only for a backend that overrides ``hicache_page_keys``: a
seeded hypothesis search over configs that differ in exactly one identity field (model names
that slug alike, ``model_revision``, dtype, layout, tp/pp/cp rank and size), and over pools,
components, draft and page hashes, requires disjoint key sets.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from hicache_core import (
    HiCacheError,
    IoOp,
    PoolName,
    PoolTransfer,
    StorageConfig,
    Store,
    check_key,
    open_store,
)

from ._base import SuiteBase
from ._context import SuiteContext
from ._keyprops import KEY_FIELDS, RANK_FIELDS
from ._options import isolate_path_options, path_option_names
from ._rules import rule

__all__ = ["KeyTests"]

KV = PoolName.KV
DEPTH = 4  # the storage path sits DEPTH directories below the cage


class _OutsideStr(str):
    """A valid-looking key whose ``__str__`` / ``__fspath__`` / ``__format__`` name a path outside."""

    outside = ""

    def __str__(self) -> str:
        return self.outside

    def __fspath__(self) -> str:
        return self.outside

    def __format__(self, spec: str) -> str:
        return self.outside


def _snapshot(root: Path) -> dict[str, tuple[str, int, str]]:
    """Every entry under ``root``: relative path -> (kind, size, content digest of small files)."""
    out: dict[str, tuple[str, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full) or not os.path.isdir(full):
                size = os.lstat(full).st_size
                digest = ""
                if os.path.isfile(full) and size <= 1 << 20:
                    with open(full, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                out[rel] = ("regular", size, digest)
            else:
                out[rel] = ("dir", 0, "")
    return out


def _hostile_keys(cage: Path, decoy: str) -> list[str]:
    ups = [("../" * d) + decoy for d in range(1, DEPTH + 3)]  # up to the test's tmp_path
    sneaky = _OutsideStr("conformance-sneaky.kv.k.tp0of1.0123456789abcdef")
    sneaky.outside = str(cage / decoy)
    return [
        *ups,
        str(cage / decoy),  # absolute
        str(cage / "escape-abs"),
        "a/b",
        "ns.kv.k.tp0of1/" + "../" * (DEPTH + 2) + decoy,
        "a\\b",
        "..",
        ".",
        "",
        "a\x00b",
        "k" * 4096,
        "ключ.kv.k.tp0of1.ü",
        sneaky,
    ]


class KeyTests(SuiteBase):
    """Hostile keys at the I/O hooks; properties of a custom key scheme."""

    # ----------------------------------------------------------------- errors
    def _caged_store(
        self, hc: SuiteContext, tmp_path: Path, decoy: str
    ) -> tuple[Store, Any, Path, Callable[[], list[str]]]:
        """A store whose every path option lies DEPTH directories deep inside ``tmp_path / "hostile-cage"``
        with decoy files in the cage and around it; returns the store, its KV pool, the cage and a
        function listing what changed outside the store's storage since this call."""
        cage = tmp_path / "hostile-cage"
        deep = cage.joinpath(*(f"l{i}" for i in range(1, DEPTH + 1)))
        deep.mkdir(parents=True)
        fields = getattr(hc.cls.Options, "model_fields", {})  # type: ignore[attr-defined]
        path_fields = sorted(
            {f for f in self.tmp_dir_options if f in fields} | set(path_option_names(hc.cls))
        )
        options = isolate_path_options(
            hc.cls, {k: v for k, v in hc.options.items() if k not in path_fields}, deep
        )
        for f in path_fields:
            if options.get(f) is None:
                options[f] = str(deep / f"hicache-{f}")
        known = [str(options[f]) for f in path_fields] + [
            str(hc.options[f]) for f in path_fields if hc.options.get(f)
        ]
        store = hc.open(options=options)
        pool = self.make_kv_pool("mha", 2)
        store.register_pool(KV, pool)
        nbytes = pool.component_nbytes[0]
        for d in (tmp_path, cage, *(p for p in deep.parents if cage in p.parents), deep):
            (d / decoy).write_bytes(bytes(range(256)) * (nbytes // 256) + b"\x01" * (nbytes % 256))
        before = _snapshot(tmp_path)

        def changed_outside() -> list[str]:
            after = _snapshot(tmp_path)
            return sorted(
                rel
                for rel in set(before) | set(after)
                if before.get(rel) != after.get(rel)
                and not any(str(tmp_path / rel).startswith(s) for s in known)
            )

        return store, pool, cage, changed_outside

    @rule("R25")
    def test_errors_hostile_keys(self, hc: SuiteContext, io_path: str, tmp_path: Path) -> None:
        """R25: Unsafe keys sent straight to the I/O hook (no controller, no store check) raise a typed
        ``HiCacheError`` or answer ``False``, and nothing outside the backend's storage changes."""
        decoy = "decoy"
        store, pool, cage, changed_outside = self._caged_store(hc, tmp_path, decoy)
        (good,) = store.page_keys(KV, self.make_page_hashes(1))
        problems: list[str] = []
        for key in _hostile_keys(cage, decoy):
            for op in (IoOp.SET, IoOp.EXISTS, IoOp.GET):
                for what, call in self._hostile_calls(store, pool, io_path, op, key, good):
                    problems += _judge(what, call)
        outside = changed_outside()
        assert not outside, (
            f"backend {hc.name!r}: {io_path} I/O with hostile keys created or changed paths outside its "
            f"storage: {outside[:8]}; validate keys at the hook with hicache_core.check_keys"
        )
        assert not problems, f"backend {hc.name!r}: " + "; ".join(problems[:6])

    @rule("R25", "R26")
    def test_errors_hostile_clear_namespace(self, hc: SuiteContext, tmp_path: Path) -> None:
        """R25, R26: ``hicache_clear`` with a namespace no config produces (``..`` paths, an absolute
        path, glob patterns, empty, NUL) raises a typed ``HiCacheError`` or removes nothing: the
        store's own pages and everything outside its storage stay."""
        hc.require_hook("hicache_clear")
        decoy = "decoy"
        store, pool, cage, changed_outside = self._caged_store(hc, tmp_path, decoy)
        hashes = self.make_page_hashes(2)
        keys = store.page_keys(KV, hashes)
        flat = [k for page in keys for k in page]
        views = [v for page in pool.page_views([0, 1]) for v in page]
        if hc.caps.v1:
            stored = store.pm.hook.hicache_batch_io_v1(op=IoOp.SET, keys=flat, buffers=views, pool_name=KV)
        else:
            one = PoolTransfer(KV, (0, 1), tuple(hashes), pool.hit_policy, tuple(keys))
            stored = _first(store.pm.hook.hicache_batch_io_v2(op=IoOp.SET, transfers=[one]))
        assert all(stored), f"backend {hc.name!r}: SET of 2 pages failed: {stored}"
        ns = store.keys.scheme.namespace
        hostile = [
            *(("../" * d) + decoy for d in range(1, DEPTH + 3)),
            str(cage / decoy),
            "*",
            "?",
            ns[:-1] + "*",
            "[a-z]*",
            "",
            ".",
            "..",
            "a/b",
            "a\x00b",
        ]
        problems: list[str] = []
        for bad in hostile:
            try:
                removed = store.pm.hook.hicache_clear(namespace=bad)
            except HiCacheError:
                continue
            except Exception as err:  # reported below, not raised
                problems.append(f"hicache_clear({bad!r}) raised untyped {type(err).__name__}: {err}")
                continue
            if removed:
                problems.append(f"hicache_clear({bad!r}) removed {removed} objects")
        outside = changed_outside()
        assert not outside, (
            f"backend {hc.name!r}: hicache_clear with hostile namespaces changed paths outside its storage: "
            f"{outside[:8]}; validate the namespace with hicache_core.check_key before using it in a path"
        )
        if hc.caps.v1:
            left = store.pm.hook.hicache_batch_io_v1(op=IoOp.EXISTS, keys=flat, buffers=None, pool_name=KV)
        else:
            left = _first(store.pm.hook.hicache_batch_io_v2(op=IoOp.EXISTS, transfers=[one]))
        if not all(left):
            problems.append(f"this namespace's pages are gone after hostile clears: exists {left}")
        assert not problems, (
            f"backend {hc.name!r}: " + "; ".join(problems[:6]) + "; match only keys that start with the "
            'exact namespace + "." (no glob, no path built from it)'
        )

    def _hostile_calls(
        self, store: Store, pool: Any, path: str, op: IoOp, key: str, good: tuple[str, ...]
    ) -> Iterator[tuple[str, Callable[[], Any]]]:
        """(description, call) pairs for one key: the key alone, and after a valid key."""
        views = [v for page in pool.page_views([0, 1]) for v in page]
        name = f"{path} {op.value} of {key[:60]!r}{'...' if len(key) > 60 else ''}"
        if type(key) is not str:
            name += f" (a str subclass naming {str(key)!r})"
        if path == "v1":
            hook = store.pm.hook.hicache_batch_io_v1
            yield (
                name,
                lambda: (
                    hook(op=op, keys=[key], buffers=None if op is IoOp.EXISTS else views[:1], pool_name=KV),
                    0,
                ),
            )
            keys = [good[0], key]
            yield (
                name + " after a valid key",
                lambda: (
                    hook(op=op, keys=keys, buffers=None if op is IoOp.EXISTS else views[:2], pool_name=KV),
                    1,
                ),
            )
            return
        hook2 = store.pm.hook.hicache_batch_io_v2
        page_hash = "0123456789abcdef"
        one = PoolTransfer(KV, (0,), (page_hash,), pool.hit_policy, ((key, key),))
        yield name, lambda: (_first(hook2(op=op, transfers=[one])), 0)
        two = PoolTransfer(
            KV, (1, 0), ("fedcba9876543210", page_hash), pool.hit_policy, (good, (good[0], key))
        )
        yield name + " in a page after a valid one", lambda: (_first(hook2(op=op, transfers=[two])), 1)

    # -------------------------------------------------------------- isolation
    @rule("R21", "R22")
    @pytest.mark.parametrize("field", KEY_FIELDS)
    def test_isolation_custom_keys(self, hc: SuiteContext, field: str) -> None:
        """R21, R22: A custom ``hicache_page_keys``: configs differing in one identity field (model names that
        slug alike, revision, dtype, layout, tp/pp/cp rank and size), pools, components, draft and
        page hashes never share a key (hypothesis, seeded)."""
        if not callable(getattr(hc.cls, "hicache_page_keys", None)):
            pytest.skip(
                f"backend {hc.name!r} uses the core's default key scheme (it does not override "
                "hicache_page_keys); the core's own tests cover that scheme"
            )
        if field == "model_revision" and field not in StorageConfig.model_fields:
            pytest.skip("this hicache-core's StorageConfig has no model_revision field")
        pytest.importorskip("hypothesis", reason="install hicache-core[testing] (hypothesis) for this test")
        from hypothesis import HealthCheck, Phase, given, settings

        from ._keyprops import explicit_cases, field_cases

        keys_of = functools.partial(self._keys_of, hc)
        checked = [0]

        def distinct(case: tuple[dict[str, Any], dict[str, Any], list[str], str]) -> None:
            a, b, hashes, what = case
            ka = keys_of(a, hashes)
            if field in ("pool", "component", "draft", "page_hash"):
                _distinct_within(hc.name, ka, f"{field} ({what})")
            else:
                kb = keys_of(b, hashes)
                per_rank = field in RANK_FIELDS
                shared = sorted(set(_flat(ka, per_rank)) & set(_flat(kb, per_rank)))
                assert not shared, (
                    f"backend {hc.name!r}: configs differing only in {field} ({what}) share keys "
                    f"{shared[:3]}: one would read the other's pages"
                )
            checked[0] += 1

        for case in explicit_cases(field):  # the classic collisions first, on every run
            distinct(case)
        budget = settings(
            max_examples=self.key_examples,
            derandomize=True,
            database=None,
            deadline=None,
            phases=(Phase.explicit, Phase.generate),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        decorate = cast(Callable[[Callable[..., None]], Any], given(field_cases(field)))
        search = cast(Callable[[Any], Callable[[], None]], budget)(decorate(distinct))
        search()
        assert checked[0] > 0

    def _keys_of(self, hc: SuiteContext, overrides: dict[str, Any], hashes: list[str]) -> dict[str, Keyed]:
        """Keys of ``hashes`` in every declared pool of a store opened with ``overrides``: per pool
        label (``kv`` and ``draft``, both MHA; ``mamba``; ``indexer``), whether the pool is
        rank-replicated and, per page, ``(component, key)`` pairs."""
        pools = {
            "kv": (KV, self.make_kv_pool("mha", 2, allocate=False)),
            "draft": (PoolName.DRAFT, self.make_kv_pool("mha", 2, allocate=False)),
            "mamba": (PoolName.MAMBA, self.make_mamba_pool(2, allocate=False)),
            "indexer": (PoolName.INDEXER, self.make_indexer_pool(2, allocate=False)),
        }
        out: dict[str, Keyed] = {}
        with open_store(hc.config(**overrides)) as store:
            for label, (name, pool) in pools.items():
                if name not in store.capabilities.pools:
                    continue
                store.register_pool(name, pool)
                keys = store.page_keys(name, hashes)
                pages = []
                for page in keys:
                    assert len(page) == len(pool.components), f"{label}: keys {page} for {pool.components}"
                    pages.append([(comp, check_key(key)) for comp, key in zip(pool.components, page)])
                out[label] = (pool.rank_replicated, pages)
        return out


Keyed = tuple[bool, list[list[tuple[str, str]]]]
"""One pool's keys: (rank-replicated, per page the (component, key) pairs)."""


def _flat(keys: dict[str, Keyed], per_rank_only: bool) -> list[str]:
    return [
        key
        for replicated, pages in keys.values()
        if not (per_rank_only and replicated)
        for page in pages
        for _, key in page
    ]


def _distinct_within(backend: str, keys: dict[str, Keyed], what: str) -> None:
    """Every (pool, page, component) of one store has a key of its own."""
    owner: dict[str, str] = {}
    for label, (_, pages) in keys.items():
        for i, page in enumerate(pages):
            for comp, key in page:
                me = f"{label} page {i} component {comp!r}"
                assert key not in owner, (
                    f"backend {backend!r}, {what}: {owner[key]} and {me} share the key {key!r}"
                )
                owner[key] = me


def _first(result: Any) -> Any:
    return result[0] if isinstance(result, list) and result else result


def _judge(what: str, call: Callable[[], tuple[Any, int]]) -> list[str]:
    """A hostile-key call must raise a typed ``HiCacheError`` or answer False at ``position``."""
    try:
        result, position = call()
    except HiCacheError:
        return []
    except Exception as err:
        return [f"{what} raised {type(err).__name__}: {err!s:.120} (raise a hicache_core.HiCacheError)"]
    if not isinstance(result, list) or len(result) <= position:
        return [f"{what} returned {result!r:.120}"]
    if result[position] is not False:
        return [
            f"{what} answered {result[position]!r}: an unsafe key must be refused (hicache_core.check_keys)"
        ]
    return []
