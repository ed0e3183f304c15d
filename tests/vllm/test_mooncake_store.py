"""vLLM with the ``mooncake`` backend: two engine processes share a real Mooncake store.

The store is a standalone Mooncake cluster started on 127.0.0.1 by the session fixture
``mooncake_standalone`` (``mooncake_master`` plus a real ``mooncake_client`` holding the
segment), so the pages outlive the process that wrote them.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from tiny_model import BLOCK, PROMPTS
from vllm_helpers import run_engine

# the engines start in fresh processes: minutes on a loaded 2-core machine
pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(900)]


def test_two_processes_share_a_mooncake_store(
    tiny_models: list[Path], mooncake_standalone: Any, baseline: Future[dict[str, Any]]
) -> None:
    cfg = {"backend": "mooncake", "options": mooncake_standalone.options(load_env=False)}
    model = str(tiny_models[0])
    # A saves on the save thread (async_save), B loads in the default (synchronous) mode
    a = run_engine({"model": model, "prompts": PROMPTS, "connector": {**cfg, "async_save": True}})
    b = run_engine({"model": model, "prompts": PROMPTS, "connector": cfg})
    assert [r["num_cached_tokens"] for r in a["results"]] == [0, 0]
    assert a["stats"]["transfers"]["save_pages"] == 12
    for r in b["results"]:
        assert r["num_cached_tokens"] == 6 * BLOCK
    expected = [r["token_ids"] for r in baseline.result()["results"]]
    assert [r["token_ids"] for r in b["results"]] == [r["token_ids"] for r in a["results"]] == expected
    assert b["stats"]["transfers"]["load_pages"] == 12
    assert b["stats"]["transfers"]["load_failed_pages"] == 0
