"""The conformance suite against the ``file`` backend (plugins/file), on a fresh root per test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache_core.testing import BackendConformance


class TestFileBackend(BackendConformance):
    """Every group runs: v1 + v2, all pools, draft ``generic``, persistent, shared, clear."""

    backend = "file"

    @pytest.fixture
    def options(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path / "file-root")}
