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

_MOONCAKE_FIXTURES = {"mooncake_master", "mooncake_master_factory", "mooncake_standalone"}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: ``-n 3 --dist loadgroup``) each file is one group, so a
    module's fixtures are built once; every file that starts real Mooncake processes joins one
    group, so one worker runs them one after another, as a serial run does (and the session's
    master is shared by them)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    for path, file_items in files.items():
        # draft_matrix starts Mooncake from a parametrized fixture (request.getfixturevalue)
        mooncake = (
            "mooncake" in path.name
            or "draft_matrix" in path.parts
            or any(
                item.get_closest_marker("mooncake")
                or _MOONCAKE_FIXTURES & set(getattr(item, "fixturenames", ()))
                for item in file_items
            )
        )
        group = pytest.mark.xdist_group("mooncake" if mooncake else str(path))
        for item in file_items:
            item.add_marker(group)


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
