"""``SuiteBase``: fixtures, geometry and data generation shared by every test group.

Everything here is meant to be overridden by a backend author's subclass of
:class:`~hicache_core.testing.BackendConformance`: the backend name and options, the pool
geometry, the page hashes and the page bytes, and the expected failures.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from hicache_core import (
    HiCacheError,
    HostPool,
    IndexerPool,
    Layout,
    MambaPool,
    MHAKVPool,
    MLAKVPool,
    PoolName,
    page_hashes,
)
from hicache_core.plugin import availability, load_backend_class

from ._context import PATHS, SuiteContext, default_page_bytes
from ._options import isolate_path_options, path_option_names

__all__ = ["SuiteBase"]

_CLASSES: dict[tuple[str, tuple[str, ...]], type] = {}  # entry-point scans are slow; cache lookups


class SuiteBase:
    """Configuration and fixtures of the conformance suite (see :class:`BackendConformance`)."""

    #: Entry-point name of the backend under test (group ``hicache.backends``).
    backend: ClassVar[str | None] = None
    #: Options passed to the backend (validated by its ``Options`` model).
    backend_options: ClassVar[Mapping[str, Any]] = {}
    #: Options fields that receive a fresh path under the test's ``tmp_path`` when not supplied
    #: (a storage directory such as ``root``, or a file prefix such as hf3fs' ``file_path_prefix``).
    tmp_dir_options: ClassVar[tuple[str, ...]] = ("root", "file_path_prefix")
    #: Expected failures: test name (``test_x`` or ``test_x[param]``) -> reason (strict xfail).
    expected_failures: ClassVar[Mapping[str, str]] = {}

    #: Pool geometry (small, so 300-page batches stay fast).
    page_size: ClassVar[int] = 4
    num_layers: ClassVar[int] = 2
    num_heads: ClassVar[int] = 2
    head_dim: ClassVar[int] = 8
    kv_dim: ClassVar[int] = 16
    index_dim: ClassVar[int] = 8
    kv_dtype: ClassVar[torch.dtype] = torch.bfloat16
    #: Hypothesis budget of ``test_stateful_dict_model`` (split over the declared I/O paths).
    stateful_examples: ClassVar[int] = 12
    stateful_steps: ClassVar[int] = 15
    #: Hypothesis examples per identity field of ``test_isolation_custom_keys``.
    key_examples: ClassVar[int] = 12
    #: Bytes of one page component in ``test_concurrency_no_torn_pages`` (big, so that a torn or
    #: in-place write is seen by the concurrent readers on every run).
    torn_component_bytes: ClassVar[int] = 1 << 20

    # ------------------------------------------------------------- fixtures
    @pytest.fixture
    def backend_name(self) -> str:
        """The backend under test; defaults to the ``backend`` class attribute."""
        if not self.backend:
            pytest.fail(
                f'{type(self).__name__} must name the backend under test: set `backend = "NAME"` '
                "(its entry-point name) or override the `backend_name` fixture",
                pytrace=False,
            )
        return self.backend

    @pytest.fixture
    def base_options(self) -> dict[str, Any]:
        """Options before isolation; defaults to the ``backend_options`` class attribute."""
        return dict(self.backend_options)

    @pytest.fixture
    def options(self, backend_name: str, base_options: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
        """The options of one test: ``isolated_options(...)`` of ``base_options``."""
        return self.isolated_options(backend_name, base_options, tmp_path)

    @pytest.fixture
    def hc(
        self,
        request: pytest.FixtureRequest,
        backend_name: str,
        base_options: dict[str, Any],
        options: dict[str, Any],
    ) -> Iterator[SuiteContext]:
        """The :class:`SuiteContext` of one test; closes its stores at teardown."""
        node = request.node
        reason = self.expected_failures.get(node.name) or self.expected_failures.get(
            getattr(node, "originalname", node.name)
        )
        if reason:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
        cls = self.backend_class(backend_name)
        paths = {*path_option_names(cls), *self.tmp_dir_options}
        isolated = any(options.get(f) != base_options.get(f) for f in paths)
        ctx = SuiteContext(self, backend_name, cls, options, isolated=isolated)
        try:
            yield ctx
        finally:
            ctx.close()

    @pytest.fixture(params=PATHS)
    def io_path(self, request: pytest.FixtureRequest, hc: SuiteContext) -> str:
        """The raw I/O path a semantic test runs through: ``[v1]`` and ``[v2]`` in the test id; the
        one the backend does not declare skips with the capability named."""
        path: str = request.param
        hc.require_path(path)
        return path

    # ------------------------------------------------------ overridable hooks
    def backend_class(self, name: str) -> type:
        """Resolve the backend class; skips the test when the backend cannot run here."""
        key = (name, tuple(sys.path))
        cls = _CLASSES.get(key)
        if cls is None:
            try:
                cls = _CLASSES[key] = load_backend_class(name)
            except HiCacheError as err:
                pytest.fail(f"cannot load backend {name!r}: {err}", pytrace=False)
        reason = availability(cls)
        if reason is not None:
            pytest.skip(f"backend {name!r} cannot run here: {reason}")
        return cls

    def isolated_options(self, backend_name: str, options: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
        """Give each test storage of its own.

        Every path option of the backend's ``Options`` (typed ``pathlib.Path``, or marked with
        ``json_schema_extra={"format": "path"}``; also any field named in ``tmp_dir_options``)
        that the caller did not set gets a fresh path ``tmp_path / "hicache-<field>"`` (not
        created, unless it is a ``DirectoryPath``: the backend creates its storage there). Tests also use a unique
        ``model_name`` (so a unique key namespace), and stores on non-isolated storage are
        cleared at teardown when the backend implements ``hicache_clear``. Override this for
        other kinds of isolation (a per-test database, bucket, or server).
        """
        cls = self.backend_class(backend_name)
        fields = getattr(cls.Options, "model_fields", {})  # type: ignore[attr-defined]
        out = isolate_path_options(cls, options, tmp_path)
        for name in self.tmp_dir_options:
            if name in fields and out.get(name) is None:
                out[name] = str(tmp_path / f"hicache-{name}")
        return out

    def make_page_hashes(self, n: int, salt: int = 0) -> list[str]:
        """``n`` chained page hashes (``hicache_core.page_hashes`` of seeded random tokens)."""
        rng = random.Random(f"hicache-conformance-{salt}")
        tokens = [rng.randrange(0, 1 << 31) for _ in range(n * self.page_size)]
        return page_hashes(tokens, self.page_size)

    def page_bytes(self, page_hash: str, component: str, nbytes: int, salt: int) -> torch.Tensor:
        """The bytes stored for one page component: deterministic in all four arguments."""
        return default_page_bytes(page_hash, component, nbytes, salt)

    def make_kv_pool(
        self, kind: str, num_pages: int, *, layout: Layout | str = Layout.PAGE_FIRST, allocate: bool = True
    ) -> HostPool:
        """An MHA (``"mha"``: ``k`` and ``v``) or MLA (``"mla"``: ``kv``) KV pool."""
        if kind == "mla":
            return MLAKVPool(
                num_pages,
                self.page_size,
                self.num_layers,
                self.kv_dim,
                self.kv_dtype,
                layout=layout,
                allocate=allocate,
            )
        return MHAKVPool(
            num_pages,
            self.page_size,
            self.num_layers,
            self.num_heads,
            self.head_dim,
            self.kv_dtype,
            layout=layout,
            allocate=allocate,
        )

    def make_mamba_pool(
        self, num_slots: int, *, layout: Layout | str = Layout.PAGE_FIRST, allocate: bool = True
    ) -> HostPool:
        """A Mamba state pool: ``temporal`` plus two conv buffers."""
        return MambaPool(
            num_slots, self.num_layers, (2, 4), [(3, 4), (2, 8)], layout=layout, allocate=allocate
        )

    def make_indexer_pool(
        self, num_pages: int, *, layout: Layout | str = Layout.PAGE_FIRST, allocate: bool = True
    ) -> HostPool:
        """A DSA indexer pool."""
        return IndexerPool(
            num_pages, self.page_size, self.num_layers, self.index_dim, layout=layout, allocate=allocate
        )

    def declared_pools(
        self, caps_pools: frozenset[PoolName], num_pages: int, *, layout: Layout | str = Layout.PAGE_FIRST
    ) -> dict[PoolName, HostPool]:
        """One pool of every kind in ``caps_pools``: MHA KV, Mamba, indexer and draft, in that order."""
        makers: dict[PoolName, Callable[[], HostPool]] = {
            PoolName.KV: lambda: self.make_kv_pool("mha", num_pages, layout=layout),
            PoolName.MAMBA: lambda: self.make_mamba_pool(num_pages, layout=layout),
            PoolName.INDEXER: lambda: self.make_indexer_pool(num_pages, layout=layout),
            PoolName.DRAFT: lambda: self.make_draft_pool(num_pages, layout=layout),
        }
        return {name: make() for name, make in makers.items() if name in caps_pools}

    def make_draft_pool(
        self, num_pages: int, *, layout: Layout | str = Layout.PAGE_FIRST, allocate: bool = True
    ) -> HostPool:
        """A draft (speculative decoding) KV pool: a one-layer MHA pool."""
        return MHAKVPool(
            num_pages,
            self.page_size,
            1,
            self.num_heads,
            self.head_dim,
            self.kv_dtype,
            layout=layout,
            allocate=allocate,
        )
