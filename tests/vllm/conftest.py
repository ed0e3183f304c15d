"""vLLM end-to-end tests: real engines serving a tiny random Llama through ``HiCacheConnector``.

They need vLLM, which lives in its own venv (``integrations/vllm/setup-dev.sh`` creates
``.venv-vllm/``); run them with ``.venv-vllm/bin/python -m pytest tests/vllm``. Where vLLM is not
importable (the main ``.venv``) they are skipped with that reason, except under ``CI=true``, where
a missing vLLM is an error: CI must run them.

Every engine runs in a fresh process (``engine_worker.py``), so "a fresh vLLM with an empty
prefix cache" is literally a new process; the engines are shared between the tests of a module
through module-scoped fixtures, and independent ones run two at a time.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import run_engine

HERE = Path(__file__).resolve().parent
_SPEC = importlib.util.find_spec("vllm")
# A namespace package (no origin) is this very directory, found through the tests folder on
# sys.path, not vLLM.
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
SKIP_REASON = (
    "vLLM is not importable in this interpreter; run `bash integrations/vllm/setup-dev.sh` and "
    "`.venv-vllm/bin/python -m pytest tests/vllm`"
)

if not HAVE_VLLM and IN_CI:
    raise pytest.UsageError(f"CI=true but {SKIP_REASON}: the vLLM tests must run in CI")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if str(item.path).startswith(str(HERE)):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two tiny random Llamas with the same architecture and different weights."""
    from tiny_model import build_tiny_llama

    root = tmp_path_factory.mktemp("models")
    return [build_tiny_llama(root / f"llama-{seed}", seed) for seed in (0, 1)]


@pytest.fixture(scope="session")
def engines() -> Iterator[ThreadPoolExecutor]:
    """Runs independent engine processes two at a time (this machine class has two cores)."""
    with ThreadPoolExecutor(2, thread_name_prefix="engine") as pool:
        yield pool


@pytest.fixture(scope="session")
def baseline(tiny_models: list[Path], engines: ThreadPoolExecutor) -> Future[dict[str, Any]]:
    """Model 0 serving ``PROMPTS`` without any connector (the reference output), started in the
    background: ``.result()`` waits for it."""
    from tiny_model import PROMPTS

    return engines.submit(run_engine, {"model": str(tiny_models[0]), "prompts": PROMPTS})
