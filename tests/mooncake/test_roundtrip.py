"""Round trips through the CacheController on the real store, embedded and standalone."""

from __future__ import annotations

from typing import Any

import pytest
from mooncake_helpers import KINDS, make_config, make_group, roundtrip

from hicache_core import CacheController, PoolName


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "hybrid"])
def test_v2_roundtrip(mode_opts: dict[str, Any], kind: str) -> None:
    group = make_group(kind)
    with CacheController(make_config(mode_opts, kind), group) as ctl:
        assert ctl.io_path == "v2"
        assert ctl.draft_enabled == (PoolName.DRAFT in group)
        roundtrip(ctl, group)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_v1_layer_first_roundtrip(mode_opts: dict[str, Any], kind: str) -> None:
    """layer_first pools take the v1 path: strided page views move as multi-range objects."""
    group = make_group(kind, layout="layer_first")
    with CacheController(make_config(mode_opts, kind, layout="layer_first"), group) as ctl:
        assert ctl.io_path == "v1"
        roundtrip(ctl, group)
