"""Project-wide fixtures: in-memory test backends installed as a real throwaway distribution."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.distinfo import installed_dist

try:  # real Mooncake process fixtures, declared once so every directory shares one master
    from hicache_mooncake.testing import (  # noqa: F401
        mooncake_master,
        mooncake_master_factory,
        mooncake_standalone,
    )
except ImportError:  # pragma: no cover - the mooncake plugin is part of the dev install
    pass
from tests.support.membackend import MEMORY_ENTRY_POINTS, SHARED


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="hicache: run the long reliability variants (>= 100 crash kills, 10x fuzz cases)",
    )


@pytest.fixture
def memory_backends(tmp_path: Path) -> Iterator[list[str]]:
    """Install the ``memory*`` test backends (entry points in a real dist-info on sys.path)."""
    SHARED.clear()
    with installed_dist(
        tmp_path / "site", "hicache-test-memory", {"hicache.backends": MEMORY_ENTRY_POINTS}, {}
    ):
        yield list(MEMORY_ENTRY_POINTS)
    SHARED.clear()
