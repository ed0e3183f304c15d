"""The core's conformance suite against the real store, in both deployment modes.

* embedded: ``setup()`` clients that contribute no memory (``global_segment_size=0``) on a
  cluster whose memory is a real ``mooncake_client`` (HTTP metadata), so pages outlive the
  process that wrote them, as the suite's ``shared`` test requires;
* standalone: dummy clients (``setup_dummy``) of that same ``mooncake_client``.

Embedded clients that contribute their own segment (the default, P2PHANDSHAKE on a bare master)
are covered by the other test modules.
"""

from __future__ import annotations

from typing import Any

import pytest

from hicache_core.testing import BackendConformance
from hicache_mooncake.testing import MooncakeStandalone


class TestMooncakeEmbedded(BackendConformance):
    backend = "mooncake"

    @pytest.fixture
    def base_options(self, mooncake_standalone: MooncakeStandalone) -> dict[str, Any]:
        m = mooncake_standalone.master
        return {
            "master_server_address": m.address,
            "metadata_server": m.metadata_server,
            "local_hostname": "127.0.0.1",
            "global_segment_size": 0,
            "load_env": False,
        }


class TestMooncakeStandalone(BackendConformance):
    backend = "mooncake"

    @pytest.fixture
    def base_options(self, mooncake_standalone: MooncakeStandalone) -> dict[str, Any]:
        return mooncake_standalone.options(load_env=False)
