"""Boolean switches accept only boolean words; anything else is a ConfigError naming the variable."""

from __future__ import annotations

import pytest

import hicache_core as hc
from hicache_core import env


@pytest.mark.parametrize("on", ["1", "true", "Yes", " ON "])
def test_on_values(on: str) -> None:
    assert env.env_flag("HICACHE_TRACE", {"HICACHE_TRACE": on})


@pytest.mark.parametrize("bad", ["maybe", "2", "enable", "-1"])
def test_other_values_are_refused(bad: str) -> None:
    with pytest.raises(hc.ConfigError, match=r"HICACHE_TRACE=.* is not a boolean switch") as info:
        env.env_flag("HICACHE_TRACE", {"HICACHE_TRACE": bad})
    assert isinstance(info.value, ValueError)
