"""Fixtures of the conformance tests: the example backends as a distribution on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.helpers import write_examples_site


@pytest.fixture(scope="session")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory with ``hicache-broken-backends`` (every backend of broken_backends*.py)."""
    return write_examples_site(tmp_path_factory.mktemp("broken-site"))
