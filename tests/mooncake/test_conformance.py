"""The core's conformance suite against the real store, in both deployment modes.

* embedded: ``setup()`` clients (P2PHANDSHAKE) that each contribute a segment, on the session's
  bare ``mooncake_master``; the suite's second process is such a client too;
* standalone: dummy clients (``setup_dummy``) of a real ``mooncake_client``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hicache_mooncake.testing import MooncakeMaster, MooncakeStandalone
from mooncake_helpers import embedded_options

from hicache_core.testing import BackendConformance


class TestMooncakeEmbedded(BackendConformance):
    backend = "mooncake"

    @pytest.fixture
    def base_options(self, mooncake_master: MooncakeMaster) -> dict[str, Any]:
        return embedded_options(mooncake_master)


class TestMooncakeStandalone(BackendConformance):
    backend = "mooncake"

    @pytest.fixture
    def base_options(self, mooncake_standalone: MooncakeStandalone) -> dict[str, Any]:
        return mooncake_standalone.options(load_env=False)
