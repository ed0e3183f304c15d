"""``BackendConformance``: every test group in one base class."""

from __future__ import annotations

from ._t_batch import BatchTests, PoolKindTests
from ._t_concurrency import ConcurrencyTests
from ._t_guard import GuardTests
from ._t_io import DraftTests, PoolsTests, V1Tests, V2Tests
from ._t_keys import KeyTests
from ._t_lifecycle import LifecycleTests
from ._t_semantics import SemanticsTests
from ._t_stateful import StatefulTests
from ._t_static import ContractTests, DiscoveryTests
from ._t_stores import StoresTests

__all__ = ["BackendConformance"]


class BackendConformance(
    DiscoveryTests,
    ContractTests,
    V1Tests,
    V2Tests,
    PoolsTests,
    PoolKindTests,
    BatchTests,
    DraftTests,
    SemanticsTests,
    LifecycleTests,
    StoresTests,
    ConcurrencyTests,
    KeyTests,
    StatefulTests,
    GuardTests,
):
    """The hicache backend conformance suite, as a pytest base class.

    Subclass it in a test module (the class name must match pytest's ``python_classes``,
    ``Test*`` by default) and name the backend::

        from hicache_core.testing import BackendConformance

        class TestMyBackend(BackendConformance):
            backend = "mybackend"                      # entry-point name
            backend_options = {"endpoint": "local"}     # optional
            expected_failures = {"test_shared_two_processes": "needs a running server"}

    Override the ``options`` fixture (``def options(self, backend_name, base_options, tmp_path) -> dict``) for per-test
    storage, ``isolated_options`` for other isolation schemes, the class attributes
    ``page_size``, ``num_layers``, ``num_heads``, ``head_dim``, ``kv_dim``, ``index_dim``,
    ``kv_dtype`` for pool geometry, and ``make_page_hashes`` / ``page_bytes`` /
    ``make_*_pool`` for key, value and shape generation.

    Tests are driven by the backend's declared ``capabilities``: an optional capability that is
    not declared skips with a reason; a declared one that is not honoured fails with a message
    naming it. Test names are stable (public API) and grouped by the word after ``test_``
    (see :data:`hicache_core.testing.GROUPS`); each test is tagged with the contract rules it
    checks (:data:`hicache_core.testing.RULES`, the pytest marker ``hicache_rule``).
    """
