"""The hicache conformance suite against hf3fs (design §8: every backend passes it in CI).

Each test gets its own ``file_path_prefix`` under ``tmp_path`` (the suite isolates that option).
v2 and draft tests skip by capability: hf3fs declares v1 only and draft ``unsupported``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hicache_core.testing import BackendConformance


class TestHf3fsConformance(BackendConformance):
    backend = "hf3fs"
    backend_options: ClassVar[dict[str, Any]] = {"num_slots": 1024}
