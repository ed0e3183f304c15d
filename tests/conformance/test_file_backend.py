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


class TestFileBackendExactSkipped(BackendConformance):
    """With ``exact_skipped`` an instance narrows ``set_skips_existing`` to ``False``: the suite
    judges the instance's capabilities, so the tests that need it skip instead of running."""

    backend = "file"

    @pytest.fixture
    def options(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path / "file-root"), "exact_skipped": True}

    def test_suite_uses_the_instance_capabilities(self, hc: Any) -> None:
        assert hc.class_caps.set_skips_existing is True
        assert hc.caps.set_skips_existing is False
        assert hc.caps == hc.open().capabilities


class TestFileBackendSegments(BackendConformance):
    """The segment layout (``layout: "segments"``): same capabilities, same suite."""

    backend = "file"

    @pytest.fixture
    def options(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path / "file-root"), "layout": "segments"}
