"""``hicache_sglang.testing``: an author tests a backend through the SGLang adapter with one import.

Runs CONTRIBUTING.md's example (section 1.9) on the ``file`` backend, and the helper's pools on
every SGLang layout, for MLA and for a hybrid KV + Mamba model, without an SGLang server.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="hicache_sglang.testing needs sglang (integrations/sglang/setup-dev.sh)")

from hicache_sglang.testing import (
    create_adapter,
    mamba_host_pool,
    mha_host_pool,
    mla_host_pool,
    page_bytes,
    roundtrip,
)

REPO = Path(__file__).resolve().parents[2]


def test_contributing_example_runs(tmp_path: Path) -> None:
    guide = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = guide[guide.index("### 1.9 Test through SGLang") : guide.index("### 1.10")]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert 'create_adapter("example"' in code
    namespace: dict[str, Any] = {}
    exec(compile(code.replace('"example"', '"file"'), "CONTRIBUTING.md", "exec"), namespace)
    namespace["test_example_through_sglang"](tmp_path)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_mha_pools_on_every_layout(tmp_path: Path, layout: str) -> None:
    kv = mha_host_pool(num_pages=12, layout=layout)
    adapter = create_adapter("file", {"root": str(tmp_path)}, kv)
    try:
        roundtrip(adapter, kv, pages=3)
    finally:
        adapter.clear()
        adapter.close()


def test_mla_and_hybrid_pools(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    mla = mla_host_pool()
    adapter = create_adapter("file", {"root": str(tmp_path)}, mla, is_mla=True)
    try:
        roundtrip(adapter, mla, pages=4)
    finally:
        adapter.clear()
        adapter.close()
    kv, mamba = mha_host_pool(), mamba_host_pool()
    adapter = create_adapter("file", {"root": str(tmp_path)}, kv, pools={PoolName.MAMBA: mamba})
    try:
        roundtrip(adapter, kv, pages=4)
        assert len(page_bytes(mamba, 0)) > 0  # SGLang's own flat-page format of a Mamba slot
    finally:
        adapter.clear()
        adapter.close()


def test_roundtrip_catches_a_backend_that_loses_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = mha_host_pool(num_pages=8)
    adapter = create_adapter("file", {"root": str(tmp_path)}, kv)
    real = adapter.batch_get_v1
    monkeypatch.setattr(adapter, "batch_get_v1", lambda keys, idx, *a: [True] * len(keys))  # reads nothing
    try:
        with pytest.raises(AssertionError, match="other bytes"):
            roundtrip(adapter, kv, pages=2)
    finally:
        monkeypatch.setattr(adapter, "batch_get_v1", real)
        adapter.clear()
        adapter.close()
