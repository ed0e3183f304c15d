"""The conformance suite against the in-test memory backends (tests/support/membackend.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_core.testing import BackendConformance
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
