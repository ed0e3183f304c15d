"""The conformance suite against the in-test memory backends (tests/support/membackend.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_core import PoolName
from hicache_core.plugin import load_backend_class
from hicache_core.testing import BackendConformance, SuiteContext
from tests.support.distinfo import installed_dist
from tests.support.membackend import MEMORY_ENTRY_POINTS, SHARED


@pytest.fixture(scope="module", autouse=True)
def _memory_dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Install the memory backends as a real (throwaway) distribution for this module."""
    site = tmp_path_factory.mktemp("site")
    with installed_dist(Path(site), "hicache-test-memory", {"hicache.backends": MEMORY_ENTRY_POINTS}, {}):
        yield
    SHARED.clear()


class TestMemory(BackendConformance):
    """v1 + v2 (copying), every pool, draft ``generic``."""

    backend = "memory"


class TestMemoryZeroCopy(BackendConformance):
    """v1 + zero-copy v2, draft ``zero_copy_v2``."""

    backend = "memory-zc"


class TestMemoryNoDraft(BackendConformance):
    """v1 only, KV pool only, draft ``unsupported``: most optional groups skip."""

    backend = "memory-nodraft"


class _Suite(BackendConformance):
    backend = "memory"


def _context(options: dict[str, object]) -> SuiteContext:
    return SuiteContext(_Suite(), "memory", load_backend_class("memory"), dict(options), isolated=True)


def test_canary_reports_a_get_writing_outside_its_slots() -> None:
    """The suite's canaries: a v2 get that also writes a page it was not asked for fails, by name."""
    suite, hc = _Suite(), _context({"stray_get_write": True})
    store, pool = hc.kv_store("mha", 6)
    hashes = suite.make_page_hashes(2, salt=404)
    hc.write(store, PoolName.KV, pool, hashes, [0, 1], path="v2")
    with pytest.raises(AssertionError, match=r"outside its target slots.*host page\(s\) \[4\]"):
        hc.read(store, PoolName.KV, pool, hashes, [2, 3], "v2")
    assert hc.read(store, PoolName.KV, pool, hashes, [4, 5], "v1") == [True, True]  # v1 is clean
    hc.close()


def test_controller_runs_on_the_path_asked_for() -> None:
    """``hc.controller(path=...)`` moves the target pages on that path (the store is narrowed)."""
    suite = _Suite()
    for path in ("v1", "v2"):
        hc = _context({})
        ctl = hc.controller(suite.make_kv_pool("mha", 4), path=path)
        hashes = suite.make_page_hashes(2, salt=405)
        hc.fill(ctl.pools.anchor, [0, 1], hashes)
        assert ctl.backup(hashes, [0, 1]).pages == 2 and ctl.prefetch(hashes, [2, 3]).pages == 2
        used = {call[0] for call in ctl.store.backend.calls}  # type: ignore[attr-defined]
        assert used == {path}, (path, ctl.store.backend.calls)  # type: ignore[attr-defined]
        assert hc.matches(ctl.pools.anchor, [2, 3], hashes) == [True, True]
        hc.close()
