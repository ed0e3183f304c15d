"""Reliability suite options and fixtures.

``--long`` (declared in tests/conftest.py) or ``HICACHE_LONG_TESTS=1`` selects the long
variants (>= 100 crash kills, more fuzz cases, more concurrency rounds).
"""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.fixture(scope="session")
def long_mode(pytestconfig: pytest.Config) -> bool:
    opt: Any = pytestconfig.getoption("--long", default=False)
    return bool(opt) or os.environ.get("HICACHE_LONG_TESTS", "") not in ("", "0")
