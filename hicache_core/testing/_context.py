"""``SuiteContext``: the per-test handle on the backend under test (the ``hc`` fixture).

It opens stores and controllers on the test's isolated options (and closes them at teardown),
turns capabilities into skips, and moves pages with the public API exactly as a backend user
would: ``open_store``, ``Store.page_keys`` / ``batch_io_v1`` / ``batch_io_v2`` and
``CacheController`` (``controller(path="v1" | "v2")`` makes a controller move target pages on
that path). Every store it opens carries the canary guard (:mod:`._canary`): a ``get`` that
writes host memory outside its target slots fails the test (``canary.enabled = False`` for tests
that share pools across threads on purpose).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pytest
import torch

from hicache_core import (
    CacheController,
    Capabilities,
    HostPool,
    HostPoolGroup,
    IoOp,
    Layout,
    PoolName,
    PoolTransfer,
    StorageConfig,
    Store,
    open_store,
)

from ._canary import CanaryGuard, CanaryState


class SuiteHooks(Protocol):
    """What the context asks of the test class (``SuiteBase``): the overridable data makers."""

    def page_bytes(self, page_hash: str, component: str, nbytes: int, salt: int) -> torch.Tensor: ...

    def make_kv_pool(
        self, kind: str, num_pages: int, *, layout: Layout | str = ..., allocate: bool = ...
    ) -> HostPool: ...


__all__ = ["PATHS", "SENTINEL", "SuiteContext", "default_page_bytes", "expect_flags", "tensor_digest"]

PATHS = ("v1", "v2")
"""The raw I/O paths; a semantic test runs through each one the backend declares."""

SENTINEL = 0xA5
"""Destination buffers are filled with this byte before every ``get``."""

PoolSpec = tuple[PoolName, HostPool, Sequence[str], Sequence[int]]
"""``(pool name, pool, page hashes, host indices)``: one pool's share of a raw I/O call."""


def default_page_bytes(page_hash: str, component: str, nbytes: int, salt: int = 0) -> torch.Tensor:
    """Deterministic pseudo-random bytes for one page component (same inputs, same bytes)."""
    digest = hashlib.blake2b(f"{page_hash}|{component}|{salt}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a uint8 tensor's bytes in logical (row-major) order."""
    flat = t.contiguous().view(-1)
    return hashlib.sha256(bytes(flat.tolist())).hexdigest()


class SuiteContext:
    """Everything one conformance test needs about the backend under test.

    Attributes: ``name`` (entry-point name), ``cls`` (backend class), ``class_caps``
    (``cls.capabilities``), ``caps`` (the capabilities of an instance opened with these
    options: the class's, or narrower when an option narrows them), ``options`` (the isolated
    options of this test) and ``model_name`` (unique per test, so tests never see each other's
    pages even on shared storage).
    """

    def __init__(
        self, suite: SuiteHooks, name: str, cls: type, options: dict[str, Any], *, isolated: bool
    ) -> None:
        self.suite = suite
        self.name = name
        self.cls = cls
        self.class_caps: Capabilities = cls.capabilities  # type: ignore[attr-defined]
        self._caps: Capabilities | None = None
        self.options = options
        self.isolated = isolated
        self.model_name = f"conformance-{uuid.uuid4().hex[:12]}"
        self.canary = CanaryState()
        self._stores: list[Store] = []
        self._controllers: list[CacheController] = []
        self._owned: dict[int, Store] = {}  # id(controller) -> the store hc opened for it

    # ----------------------------------------------------------- capabilities
    @property
    def caps(self) -> Capabilities:
        """The capabilities under test: an instance's for these options (opened once, lazily)."""
        if self._caps is None:
            self._caps = self.open().capabilities
        return self._caps

    def require(self, capability: str) -> None:
        """Skip the test unless the backend declares ``capabilities.<capability>``."""
        value = getattr(self.caps, capability)
        if not value:
            pytest.skip(f"backend {self.name!r} does not declare capabilities.{capability} (={value!r})")

    def require_pool(self, *pools: PoolName) -> None:
        """Skip the test unless every pool is in ``capabilities.pools``."""
        missing = [p.value for p in pools if p not in self.caps.pools]
        if missing:
            supported = sorted(p.value for p in self.caps.pools)
            pytest.skip(
                f"backend {self.name!r} does not declare pool(s) {missing} in capabilities.pools {supported}"
            )

    def require_hook(self, hook: str) -> None:
        """Skip the test unless the backend implements the optional hook ``hook``."""
        if not callable(getattr(self.cls, hook, None)):
            pytest.skip(f"backend {self.name!r} does not implement the optional hook {hook}")

    def declared(self, capability: str, detail: str) -> str:
        """An assertion message for a declared capability that is not honoured."""
        value = getattr(self.caps, capability)
        return f"backend {self.name!r} declares capabilities.{capability}={value!r} but does not honour it: {detail}"

    @property
    def path(self) -> str:
        """The raw I/O path used by path-independent tests: ``"v1"`` when declared, else ``"v2"``."""
        return "v1" if self.caps.v1 else "v2"

    @property
    def paths(self) -> list[str]:
        """Every raw I/O path the backend declares (``"v1"``, ``"v2"``)."""
        return [p for p in PATHS if getattr(self.caps, p)]

    def require_path(self, path: str) -> None:
        """Skip the test unless the backend declares the I/O path ``path`` (``capabilities.<path>``)."""
        if path not in PATHS:
            raise ValueError(f"unknown I/O path {path!r}; use one of {PATHS}")
        self.require(path)

    # ------------------------------------------------------- stores and pools
    def config(self, **overrides: Any) -> StorageConfig:
        """A :class:`StorageConfig` for the backend under test, on this test's options."""
        data: dict[str, Any] = {"backend": self.name, "options": self.options, "model_name": self.model_name}
        data.update(overrides)
        return StorageConfig(**data)

    def open(self, **overrides: Any) -> Store:
        """``open_store`` on this test's config; closed (after ``clear`` if needed) at teardown.

        Every ``get`` of the store is checked by the canaries (:mod:`._canary`)."""
        store = open_store(self.config(**overrides))
        self._stores.append(store)
        self.guard(store)
        return store

    def guard(self, store: Store) -> None:
        """Register the canary guard in ``store`` (every ``get`` is checked for stray writes)."""
        store.pm.register(CanaryGuard(self.canary, lambda: store.pools), name="hicache-conformance-canary")

    def controller(
        self,
        pools: HostPoolGroup | HostPool,
        *,
        store: Store | None = None,
        path: str | None = None,
        **overrides: Any,
    ) -> CacheController:
        """A :class:`CacheController` attaching ``pools``; closed at teardown.

        ``path`` (``"v1"`` or ``"v2"``) makes the controller move target pages on that I/O path:
        it attaches to a store of its own whose capabilities are narrowed to it (``v1``: without
        ``v2``; ``v2``: as declared, which the controller prefers). Close it with :meth:`shut`.
        """
        owned: Store | None = None
        if path is not None:
            self.require_path(path)
            if store is None:
                store = owned = self.open(**overrides)
            if path == "v1" and store.capabilities.v2:
                store.capabilities = dataclasses.replace(store.capabilities, v2=False, zero_copy=False)
        ctl = CacheController(self.config(**overrides), pools, store=store)
        self._controllers.append(ctl)
        if store is None:
            self._stores.append(ctl.store)
            self.guard(ctl.store)
        elif owned is not None:
            self._owned[id(ctl)] = owned
        if path is not None:
            assert ctl.io_path == path, (
                f"the controller chose the {ctl.io_path} path for a store narrowed to {path}: {ctl.store.capabilities}"
            )
        return ctl

    def shut(self, ctl: CacheController) -> None:
        """Close a controller and, when :meth:`controller` opened a store for it, that store."""
        ctl.close()
        owned = self._owned.pop(id(ctl), None)
        if owned is not None:
            owned.close()

    def release(self, ctl: CacheController) -> None:
        """Clear (on shared storage) and close a controller now, and stop tracking it."""
        namespace = ctl.store.keys.scheme.namespace
        cleared = callable(getattr(self.cls, "hicache_clear", None)) and not self.isolated
        if cleared and not ctl.store.closed:
            ctl.clear()
        self.shut(ctl)
        if ctl in self._controllers:
            self._controllers.remove(ctl)
        self._stores = [
            s
            for s in self._stores
            if not (s.closed and (s is ctl.store or (cleared and s.keys.scheme.namespace == namespace)))
        ]

    def kv_store(self, kind: str, num_pages: int, **overrides: Any) -> tuple[Store, HostPool]:
        """Open a store and register a fresh KV pool (``kind`` is ``"mha"`` or ``"mla"``)."""
        layout = overrides.get("layout", "page_first")
        store = self.open(is_mla_model=kind == "mla", **overrides)
        pool = self.suite.make_kv_pool(kind, num_pages, layout=layout)
        store.register_pool(PoolName.KV, pool)
        return store, pool

    def close(self) -> None:
        """Close every controller and store this test opened; clear its namespaces on shared storage.

        Namespaces are cleared (when the backend implements ``hicache_clear`` and the storage is
        not a per-test temporary one) before anything is closed, through a still-open store of
        that namespace or, when the test closed them all, through a store opened for the purpose.
        """
        errors: list[str] = []

        def attempt(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as err:  # teardown must do everything it can
                errors.append(f"{what}: {type(err).__name__}: {err}")

        if callable(getattr(self.cls, "hicache_clear", None)) and not self.isolated:
            pending: dict[str, Store | StorageConfig] = {}
            for store in self._stores:
                ns = store.keys.scheme.namespace
                if not store.closed or ns not in pending:
                    pending[ns] = store if not store.closed else store.config
            for target in pending.values():
                if isinstance(target, Store):
                    attempt("Store.clear", target.clear)
                else:
                    attempt("Store.clear", functools.partial(_clear_closed, target))
        for ctl in reversed(self._controllers):
            attempt("CacheController.close", ctl.close)
        for store in reversed(self._stores):
            attempt("Store.close", store.close)
        self._controllers.clear()
        self._stores.clear()
        self._owned.clear()
        stray = self.canary.take_new()
        if stray:
            pytest.fail(
                f"backend {self.name!r}: a get wrote host memory outside its target slots: "
                + "; ".join(stray[:6]),
                pytrace=False,
            )
        if errors:
            pytest.fail(f"backend {self.name!r} failed to clean up: " + "; ".join(errors), pytrace=False)

    # ------------------------------------------------------------------ bytes
    def fill(self, pool: HostPool, indices: Sequence[int], hashes: Sequence[str], salt: int = 0) -> None:
        """Write the expected bytes of ``hashes[i]`` into host page ``indices[i]`` of ``pool``."""
        for views, page_hash in zip(pool.page_views(indices), hashes):
            for comp, view in zip(pool.components, views):
                data = self.suite.page_bytes(page_hash, comp, view.numel(), salt)
                view.copy_(data.view(view.shape))

    @staticmethod
    def sentinel(pool: HostPool, indices: Sequence[int]) -> None:
        """Fill host pages with :data:`SENTINEL` (a get that copies nothing is caught)."""
        for views in pool.page_views(indices):
            for view in views:
                view.fill_(SENTINEL)

    def component_matches(
        self, pool: HostPool, indices: Sequence[int], hashes: Sequence[str], salt: int = 0
    ) -> list[list[bool]]:
        """Per page, per component: does the host page hold the expected bytes?"""
        self.canary.check()
        out = []
        for views, page_hash in zip(pool.page_views(indices), hashes):
            row = []
            for comp, view in zip(pool.components, views):
                expected = self.suite.page_bytes(page_hash, comp, view.numel(), salt)
                row.append(bool(torch.equal(view.reshape(-1), expected)))
            out.append(row)
        return out

    def matches(
        self, pool: HostPool, indices: Sequence[int], hashes: Sequence[str], salt: int = 0
    ) -> list[bool]:
        """Per page: does every component hold the expected bytes?"""
        return [all(r) for r in self.component_matches(pool, indices, hashes, salt)]

    # ---------------------------------------------------------------- raw I/O
    def keys_and_views(
        self, store: Store, pool_name: PoolName, pool: HostPool, hashes: Sequence[str], indices: Sequence[int]
    ) -> tuple[list[str], list[torch.Tensor]]:
        """Flat component keys and host views (component order) of the given pages."""
        keys = [k for page in store.page_keys(pool_name, list(hashes)) for k in page]
        views = [v for page in pool.page_views(indices) for v in page]
        return keys, views

    def v1(
        self,
        store: Store,
        op: IoOp,
        pool_name: PoolName,
        pool: HostPool,
        hashes: Sequence[str],
        indices: Sequence[int],
    ) -> list[bool]:
        """Raw ``batch_io_v1`` over the pages' component keys: one bool per *key*."""
        keys, views = self.keys_and_views(store, pool_name, pool, hashes, indices)
        out = store.batch_io_v1(op, keys, None if op is IoOp.EXISTS else views, pool_name)
        self.canary.check()
        return out

    def v2(self, store: Store, op: IoOp, specs: Sequence[PoolSpec]) -> list[list[bool]]:
        """Raw ``batch_io_v2``: one :class:`PoolTransfer` per spec, one bool per page."""
        transfers = []
        for pool_name, pool, hashes, indices in specs:
            keys = tuple(store.page_keys(pool_name, list(hashes))) if hashes else ()
            transfers.append(PoolTransfer(pool_name, tuple(indices), tuple(hashes), pool.hit_policy, keys))
        out = store.batch_io_v2(op, transfers)
        self.canary.check()
        return out

    def raw(
        self,
        store: Store,
        op: IoOp,
        pool_name: PoolName,
        pool: HostPool,
        hashes: Sequence[str],
        indices: Sequence[int],
        path: str | None = None,
    ) -> list[bool]:
        """Raw I/O on the given path (default :attr:`path`): one bool per *page*."""
        if (path or self.path) == "v2":
            out = self.v2(store, op, [(pool_name, pool, hashes, indices)])[0]
        else:
            flat = self.v1(store, op, pool_name, pool, hashes, indices)
            n = len(pool.components)
            out = [all(flat[i : i + n]) for i in range(0, len(flat), n)]
        self.canary.check()
        return out

    def write(
        self,
        store: Store,
        pool_name: PoolName,
        pool: HostPool,
        hashes: Sequence[str],
        indices: Sequence[int],
        salt: int = 0,
        path: str | None = None,
    ) -> None:
        """Fill host pages with the expected bytes and ``set`` them; every page must succeed."""
        self.fill(pool, indices, hashes, salt)
        ok = self.raw(store, IoOp.SET, pool_name, pool, hashes, indices, path)
        assert all(ok), (
            f"set of {len(hashes)} fresh {pool_name.value} pages reported {ok.count(False)} failures: {ok}"
        )

    def read(
        self,
        store: Store,
        pool_name: PoolName,
        pool: HostPool,
        hashes: Sequence[str],
        indices: Sequence[int],
        path: str | None = None,
    ) -> list[bool]:
        """Sentinel-fill host pages and ``get`` them; returns the per-page flags."""
        self.sentinel(pool, indices)
        return self.raw(store, IoOp.GET, pool_name, pool, hashes, indices, path)


def _clear_closed(config: StorageConfig) -> None:
    with open_store(config) as store:
        store.clear()


def expect_flags(got: Sequence[bool], expected: Sequence[bool], what: str) -> None:
    """Assert per-entry flags, naming the first mismatching positions in the message."""
    got_l, exp_l = list(got), list(expected)
    if got_l == exp_l:
        return
    if len(got_l) != len(exp_l):
        raise AssertionError(f"{what}: {len(got_l)} results for {len(exp_l)} entries: {got_l[:20]}")
    bad = [i for i, (g, e) in enumerate(zip(got_l, exp_l)) if g != e]
    shown = ", ".join(f"#{i}: got {got_l[i]} expected {exp_l[i]}" for i in bad[:8])
    raise AssertionError(f"{what}: {len(bad)} of {len(exp_l)} entries wrong ({shown})")
