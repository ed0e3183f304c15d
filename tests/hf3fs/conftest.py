"""hf3fs tests: start the slow ``hicache backends --json`` subprocess as soon as collection ends."""

from __future__ import annotations

import pytest
from hf3fs_util import start_cli_backends


def pytest_collection_finish(session: pytest.Session) -> None:
    if any("test_cli_backends_json" in item.name for item in session.items):
        start_cli_backends()
