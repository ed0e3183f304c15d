"""Fixtures of the conformance tests: the broken/reference backends as a distribution on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.helpers import HERE, MODULE, write_dist


@pytest.fixture(scope="session")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory with ``hicache-broken-backends`` (every backend of broken_backends.py)."""
    from tests.conformance.broken_backends import DEFECTS, EXTRA_ENTRY_POINTS

    source = (HERE / "broken_backends.py").read_text()
    classes = {name: cls for name, (cls, _, _) in DEFECTS.items()} | EXTRA_ENTRY_POINTS
    eps = {name: f"{MODULE}:{cls}" for name, cls in classes.items()}
    return write_dist(
        tmp_path_factory.mktemp("broken-site"), "hicache-broken-backends", eps, {MODULE: source}
    )
