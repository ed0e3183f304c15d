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
# The groups that took longest in `make test` (wall, 2 cores), longest first. They are handed out
# first (xdist keeps the collection order with --no-loadscope-reorder; its default orders by test
# count, which put the 3-test, 4-minute nixl check last, as the run's tail). A missing name only
# loses its place in the order.
_LONGEST_FIRST = (
    "mooncake",
    "tests/nixl/test_nixl_check.py",
    "tests/conformance/test_plugin_and_cli.py",
    "tests/conformance/test_file_backend.py",
    "tests/conformance/test_contributing.py",
    "tests/conformance/test_broken_backends.py",
)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    """Under pytest-xdist (``make test``: ``-n 3 --dist loadgroup``) each file is one group, so a
    module's fixtures are built once; every file that starts real Mooncake processes joins one
    group, so one worker runs them one after another, as a serial run does (and the session's
    master is shared by them). The groups of ``_LONGEST_FIRST`` are moved to the front. Runs
    after every other implementation of this hook, so the marks they add (tests/mooncake's
    ``mooncake``) are seen."""
    yield
    if getattr(config, "workerinput", None) is None or not getattr(config.option, "loadgroup", False):
        return  # not an xdist worker of a `--dist loadgroup` run: node ids stay as they are
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    groups: dict[str, str] = {}
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
        group = "mooncake" if mooncake else str(path.relative_to(config.rootpath))
        for item in file_items:
            _join_group(item, group)
            groups[item.nodeid] = group
    rank = {group: i for i, group in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(rank)))  # stable: else as collected


def _join_group(item: pytest.Item, group: str) -> None:
    """End the item's node id with ``@group``: xdist's loadgroup scheduler groups by that suffix.

    xdist (3.8) adds the suffix itself from ``xdist_group`` marks by setting ``item._nodeid``,
    which pytest 9.2 no longer reads (the id is ``item._id``, a ``NodeId``): the marks were then
    ignored, every test was scheduled alone and each worker built every module fixture again.
    Hence the suffix is set here, and a pytest where it cannot be set stops the run."""
    item.add_marker(pytest.mark.xdist_group(group))
    suffix = f"@{group}"
    if item.nodeid.endswith(suffix):
        return
    node_id = getattr(item, "_id", None)
    if hasattr(node_id, "parse"):
        item._id = type(node_id).parse(item.nodeid + suffix)  # type: ignore[attr-defined]
    else:
        item._nodeid = item.nodeid + suffix
    if not item.nodeid.endswith(suffix):
        raise pytest.UsageError(
            f"tests/conftest.py: could not put {item.nodeid} into xdist group {group!r} "
            "(this pytest stores node ids differently); run without -n, or update _join_group"
        )


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
