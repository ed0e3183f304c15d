"""Fixtures for the SGLang integration tests: real SGLang (0.5.23) code, real hicache backends."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hicache_mooncake.testing import MooncakeMaster  # mooncake_master: tests/conftest.py

# The REAL SGLang package (installed by integrations/sglang/setup-dev.sh); a missing one fails loudly.
from sglang_helpers import ADAPTER_LOADER, create


@pytest.fixture
def backend_spec(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """``(hicache backend name, options)``: ``file`` unless parametrized (indirectly) with ``mooncake``.

    Tests that must also run on Mooncake (a real ``mooncake_master``) use
    ``@pytest.mark.parametrize("backend_spec", ["file", "mooncake"], indirect=True)``; each Mooncake
    store takes about 2 s to close, so the full matrix runs on the file backend only.
    """
    if getattr(request, "param", "file") == "file":
        return "file", {"root": str(tmp_path / "hicache-file")}
    master: MooncakeMaster = request.getfixturevalue("mooncake_master")
    return "mooncake", {
        "master_server_address": master.address,
        "local_hostname": "127.0.0.1",
        "global_segment_size": "128MB",
        "local_buffer_size": "16MB",
        "load_env": False,
        "health_probe_interval_s": 0,
    }


@pytest.fixture
def make_adapter(backend_spec: tuple[str, dict[str, Any]]) -> Iterator[Callable[..., Any]]:
    """``make(kv_pool, pools=None, **config)`` -> an attached adapter on the parametrized backend.

    Every adapter of one test shares a fresh model name (so Mooncake's shared cluster never
    mixes tests) unless ``model=`` is given; all are cleared and closed afterwards.
    """
    name, options = backend_spec
    model = f"test-org/model-{uuid.uuid4().hex[:8]}"
    made: list[Any] = []

    def make(
        kv_pool: Any, *, pools: dict[Any, Any] | None = None, extra: dict[str, Any] | None = None, **cfg: Any
    ) -> Any:
        extra_config = {
            **ADAPTER_LOADER,
            "interface_v1": 1,
            "hicache_backend": name,
            "hicache_options": options,
        }
        extra_config.update(extra or {})
        cfg.setdefault("model", model)
        backend = create(extra_config, kv_pool, pools=pools, **cfg)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        try:
            backend.clear()
        finally:
            backend.close()
