"""Reliability suite options and fixtures.

``--long`` (or ``HICACHE_LONG_TESTS=1``) selects the long variants (>= 100 crash kills, more
fuzz cases, more concurrency rounds). pytest only honours ``pytest_addoption`` from the rootdir
conftest or a plugin when the option is given on the command line for a wider run such as
``pytest tests --long``; the hook here makes ``pytest tests/reliability --long`` work, and the
environment variable works everywhere.
"""

from __future__ import annotations

import os
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    try:
        parser.addoption(
            "--long", action="store_true", default=False, help="hicache: run the long reliability variants"
        )
    except ValueError:  # already added by the root conftest
        pass


@pytest.fixture(scope="session")
def long_mode(pytestconfig: pytest.Config) -> bool:
    opt: Any = pytestconfig.getoption("--long", default=False)
    return bool(opt) or os.environ.get("HICACHE_LONG_TESTS", "") not in ("", "0")
