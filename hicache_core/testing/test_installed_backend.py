"""The conformance suite against the backend named by ``--hicache-backend``.

Collected only when ``--hicache-backend NAME`` is given (see :mod:`hicache_core.testing._plugin`)::

    python -m pytest --pyargs hicache_core.testing --hicache-backend NAME [--hicache-options JSON|@file]
"""

from __future__ import annotations

from typing import Any

import pytest

from hicache_core.testing import BackendConformance
from hicache_core.testing._plugin import OPTIONS_KEY


class TestInstalledBackend(BackendConformance):
    """The whole suite; backend and options come from the command line."""

    @pytest.fixture
    def backend_name(self, request: pytest.FixtureRequest) -> str:
        name = request.config.getoption("hicache_backend", None)
        if not name:
            pytest.skip("pass --hicache-backend NAME to run the hicache conformance suite")
        return str(name)

    @pytest.fixture
    def base_options(self, request: pytest.FixtureRequest) -> dict[str, Any]:
        options: dict[str, Any] = request.config.stash.get(OPTIONS_KEY, {})
        return dict(options)
