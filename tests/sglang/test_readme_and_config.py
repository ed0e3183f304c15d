"""The README's SGLang section, the extra-config contract, stats and error behaviour."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str
from sglang_helpers import ADAPTER_LOADER, create, sglang_config
from sglang_pools import MHAHost, MLAHost, fill_random, mooncake_test_mock, page_bytes

from hicache_core import (
    BackendNotFoundError,
    ConfigError,
    OptionsError,
    PoolError,
    page_hashes,
)

REPO = Path(__file__).resolve().parents[2]
HEADING = "## Using hicache from SGLang"


def _idx(pages: list[int], page_size: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(torch.int64)


def readme_section() -> tuple[Path, str]:
    """The "Using hicache from SGLang" section of the ROOT README.

    Until the root README carries the section, the integration's own README (from which the
    root section is copied) is used.
    """
    for path in (REPO / "README.md", REPO / "integrations" / "sglang" / "README.md"):
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        if HEADING in text:
            section = text.split(HEADING, 1)[1]
            nxt = re.search(r"^## ", section, flags=re.MULTILINE)
            return path, section[: nxt.start()] if nxt else section
    raise AssertionError(f"no {HEADING!r} section in README.md or integrations/sglang/README.md")


def test_readme_extra_config_works_verbatim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, section = readme_section()
    block = re.search(r"```json\n(.*?)```", section, flags=re.DOTALL)
    assert block, f"{path}: the SGLang section has no ```json block"
    extra = json.loads(block.group(1))
    assert "--hicache-storage-backend dynamic" in section, f"{path}: the SGLang flags are missing"
    assert "--hicache-storage-backend-extra-config" in section
    assert "--enable-hierarchical-cache" in section
    launch = re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", section, flags=re.DOTALL)
    assert launch and json.loads(launch.group(1)) == extra, "the launch command must pass the JSON shown"

    monkeypatch.setenv("HOME", str(tmp_path))  # "~" in the README's options lands in tmp_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ".cache"))
    pool = MHAHost(8, 4, layer_num=2, head_num=2, head_dim=8, layout="page_first")
    fill_random(pool, 21)
    backend = create(extra, pool, model="readme/model")  # exactly the README's extra config
    try:
        keys = page_hashes(list(range(12)), 4)
        want = [page_bytes(pool, p) for p in (0, 1, 2)]
        assert backend.batch_set_v1(keys, _idx([0, 1, 2], 4)) == [True] * 3
        assert backend.batch_exists(keys) == 3
        assert backend.batch_get_v1(keys, _idx([5, 6, 7], 4)) == [True] * 3
        assert [page_bytes(pool, p) for p in (5, 6, 7)] == want
    finally:
        backend.clear()
        backend.close()


def test_sglang_page_hashes_are_hicache_page_hashes() -> None:
    """SGLang's real ``get_hash_str`` equals ``hicache_core.page_hashes`` (used by the other tests).

    SGLang builds its native hash extension with torch's JIT C++ loader on first use (g++,
    ninja and libssl headers; about 15 s once, cached in the user's cache directory).
    """
    tokens = list(range(7, 7 + 64))
    assert get_hash_str(tokens, None, page_size=16) == page_hashes(tokens, 16)
    seeded = get_hash_str(tokens[:16], "ab" * 32, page_size=16)
    assert seeded == page_hashes(tokens[:16], 16, prior_hash="ab" * 32)


def test_keys_carry_sglang_page_hash_unchanged(tmp_path: Path) -> None:
    pool = MHAHost(4, 4, layer_num=1, head_num=1, head_dim=4)
    extra = {**ADAPTER_LOADER, "hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}}
    backend = create(extra, pool, model="org/Model-7B", tp_rank=1, tp_size=2)
    try:
        h = page_hashes(list(range(4)), 4)[0]
        k, v = backend.store.page_keys("kv", [h])[0]
        assert k.endswith(".kv.k.tp1of2." + h) and v.endswith(".kv.v.tp1of2." + h)
        assert k.startswith("org-Model-7B-sglang-page_first-bfloat16-page_first-")
    finally:
        backend.close()


def test_config_errors_are_clear(tmp_path: Path) -> None:
    pool = MHAHost(4, 4, layer_num=1, head_num=1, head_dim=4)

    def make(extra: dict[str, Any]) -> Any:
        return create({**ADAPTER_LOADER, **extra}, pool)

    with pytest.raises(ConfigError, match="hicache_backend"):
        make({})
    with pytest.raises(ConfigError, match="did you mean 'hicache_options'"):
        make({"hicache_backend": "file", "hicache_option": {}})
    with pytest.raises(BackendNotFoundError, match="file"):
        make({"hicache_backend": "fiel"})
    with pytest.raises(OptionsError, match="rooot"):
        make({"hicache_backend": "file", "hicache_options": {"rooot": str(tmp_path)}})
    # SGLang's own keys (loader, interface_v1, hicache_storage_pass_prefix_keys) are left alone.
    ok = make(
        {
            "hicache_backend": "file",
            "hicache_options": {"root": str(tmp_path)},
            "hicache_storage_pass_prefix_keys": True,
            "prefetch_threshold": 256,
        }
    )
    with pytest.raises(PoolError, match="swa"):
        ok.register_mem_host_pool_v2(MHAHost(4, 4, 1, 1, 4), "swa")
    ok.close()


def test_dcp_is_refused() -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="m",
        extra_config={**ADAPTER_LOADER, "hicache_backend": "file"},
        dcp_size=2,
        dcp_rank=0,
        logical_page_size=8,
    )
    with pytest.raises(ConfigError, match="dcp_size=2"):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_io_failures_never_raise(tmp_path: Path) -> None:
    pool = MHAHost(6, 4, layer_num=1, head_num=2, head_dim=4)
    extra = {**ADAPTER_LOADER, "hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}}
    cfg = sglang_config(extra, model="m")
    unattached = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    keys = page_hashes(list(range(8)), 4)
    assert unattached.batch_exists(keys) == 0  # no pool registered yet: logged, no exception
    backend = create(extra, pool, model="m")
    try:
        assert backend.batch_get_v1(keys, torch.arange(5)) == [False, False]  # wrong numel
        assert backend.batch_set_v1(keys, _idx([0, 99], 4)) == [False, False]  # out of range
        assert backend.batch_set_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=keys[:1])]
        ) == {PoolName.MAMBA: [False]}  # unregistered pool
        groups = PoolTransfer(name=PoolName.KV, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
        assert backend.batch_exists_v2(keys, [groups]).kv_hit_pages == 0
        assert backend.get(keys[0], target_location=12345, target_sizes=8) is None  # raw pointers
        assert backend.batch_get_v1([], torch.empty(0)) == [] and backend.batch_exists([]) == 0
    finally:
        backend.close()


def test_sglang_mooncake_test_mock_pool(tmp_path: Path) -> None:
    """The host pool of SGLang's own MooncakeStore batch test (K/V interleaved in one buffer)."""
    for mla, entries in ((False, 2), (True, 1)):
        pool = mooncake_test_mock(4096, entries_per_page=entries, page_elements=64)
        extra = {**ADAPTER_LOADER, "hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}}
        backend = create(extra, pool, is_mla=mla, model=f"mock-{mla}")
        try:
            keys = [f"test_{i:04d}" for i in range(13)]  # the test's own (non-hash) key style
            assert all(backend.batch_set_v1(keys, torch.arange(13)))
            assert backend.batch_exists(keys) == 13
            assert all(backend.batch_get_v1(keys, torch.arange(13, 26)))
            for i in range(13):
                assert page_bytes(pool, 13 + i) == page_bytes(pool, i)
        finally:
            backend.close()


def test_get_stats_from_metrics_extension(tmp_path: Path) -> None:
    pool = MLAHost(8, 4, layer_num=2, kv_cache_dim=8)
    fill_random(pool, 31)
    extra = {**ADAPTER_LOADER, "hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}}
    plain = create(extra, pool, is_mla=True, model="stats")
    assert plain.get_stats() is None
    plain.close()
    backend = create(extra, pool, is_mla=True, model="stats", metrics=True)
    try:
        keys = page_hashes(list(range(12)), 4)
        backend.batch_set_v1(keys, _idx([0, 1, 2], 4))
        backend.batch_get_v1(keys[:2], _idx([4, 5], 4))
        stats = backend.get_stats()
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [2]
        assert len(stats.backup_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
        again = backend.get_stats()
        assert again.backup_pgs == [] and again.prefetch_pgs == []
    finally:
        backend.clear()
        backend.close()


def test_dtype_and_layout_namespaces_differ(tmp_path: Path) -> None:
    extra = {**ADAPTER_LOADER, "hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}}
    keys = page_hashes(list(range(8)), 4)
    bf16 = MHAHost(4, 4, 1, 1, 4, dtype=torch.bfloat16)
    a = create(extra, bf16, model="same")
    assert all(a.batch_set_v1(keys, _idx([0, 1], 4)))
    for other in (MHAHost(4, 4, 1, 1, 4, dtype=torch.float16), MHAHost(4, 4, 1, 1, 4, layout="page_head")):
        b = create(extra, other, model="same")
        assert b.batch_exists(keys) == 0
        b.close()
    a.close()


def test_a_uint8_kv_pool_needs_the_kv_dtype_named(tmp_path: Path) -> None:
    """SGLang stores fp8_e4m3 and fp8_e5m2 KV alike as uint8: the pool's dtype cannot tell them apart.

    Without ``hicache_kv_dtype`` the adapter refuses the pool (naming the key); with it, the two
    formats get separate namespaces, so an e5m2 server never reads an e4m3 server's pages.
    """
    extra = {**ADAPTER_LOADER, "hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}}
    with pytest.raises(ConfigError, match="hicache_kv_dtype"):
        create(extra, MHAHost(4, 4, 1, 1, 4, dtype=torch.uint8), model="same")
    keys = page_hashes(list(range(8)), 4)
    e4m3 = create(
        {**extra, "hicache_kv_dtype": "fp8_e4m3"}, MHAHost(4, 4, 1, 1, 4, dtype=torch.uint8), model="same"
    )
    assert all(e4m3.batch_set_v1(keys, _idx([0, 1], 4)))
    e5m2 = create(
        {**extra, "hicache_kv_dtype": "fp8_e5m2"}, MHAHost(4, 4, 1, 1, 4, dtype=torch.uint8), model="same"
    )
    assert e5m2.batch_exists(keys) == 0
    e4m3.close()
    e5m2.close()
