"""Fixtures of the draft matrix: real backends only (file, mooncake, hf3fs, nixl).

Mooncake runs against a REAL ``mooncake_master`` started by the plugin's own fixtures
(``hicache_mooncake.testing``); when that plugin is missing its cases skip with the reason
(see ``draft_util.backend_options``).
"""

from __future__ import annotations

# ``mooncake_master`` (session) is declared in tests/conftest.py.
