"""Mooncake tests run against REAL mooncake_master / mooncake_client processes.

The process fixtures come from the plugin (``hicache_mooncake.testing``): ``mooncake_master``
(session, embedded clients with P2PHANDSHAKE), ``mooncake_standalone`` (session: its own
master plus a real ``mooncake_client``; HTTP metadata) and ``mooncake_master_factory``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hicache_mooncake.testing import MooncakeMaster, MooncakeStandalone
from mooncake_helpers import embedded_options

# The process fixtures (mooncake_master, mooncake_standalone, mooncake_master_factory) are
# declared once, in tests/conftest.py, so every test directory shares the same processes.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = str(__file__).rsplit("/", 1)[0]
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.mooncake)


@pytest.fixture
def embedded_opts(mooncake_master: MooncakeMaster) -> dict[str, Any]:
    return embedded_options(mooncake_master)


@pytest.fixture
def standalone_opts(mooncake_standalone: MooncakeStandalone) -> dict[str, Any]:
    return mooncake_standalone.options(load_env=False)


@pytest.fixture(params=["embedded", "standalone"])
def mode_opts(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Options for each deployment mode in turn."""
    fixture = "embedded_opts" if request.param == "embedded" else "standalone_opts"
    return dict(request.getfixturevalue(fixture))
