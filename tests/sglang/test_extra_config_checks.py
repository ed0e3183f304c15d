"""The adapter's extra-config keys are checked when SGLang builds it; the model revision keys pages.

Public names only (SGLang's factory and ``hicache_core``), so the file also runs on older checkouts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_helpers import ADAPTER_LOADER, create, sglang_config
from sglang_pools import MHAHost, fill_random

from hicache_core import ConfigError, page_hashes


@pytest.fixture(autouse=True)
def _no_default_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config that falls back to the default root lands in tmp_path, never in the real home."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))


def _make(extra: dict[Any, Any]) -> Any:
    pool = MHAHost(4, 4, layer_num=1, head_num=1, head_dim=4)
    return create({**ADAPTER_LOADER, **extra}, pool, model="checks/model")


@pytest.mark.parametrize("options", [[], "", 0, False, "root=/x", ["root", "/x"], 3.5])
def test_hicache_options_of_the_wrong_type_is_a_config_error(tmp_path: Path, options: Any) -> None:
    with pytest.raises(ConfigError, match="hicache_options"):
        _make({"hicache_backend": "file", "hicache_options": options})


def test_non_string_extra_config_key_is_a_config_error(tmp_path: Path) -> None:
    for key in (1, None, ("hicache", "backend")):
        with pytest.raises(ConfigError, match="key") as info:
            _make({"hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}, key: "x"})
        assert repr(key) in str(info.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hicache_extensions", 0),
        ("hicache_extensions", False),
        ("hicache_extensions", {"metrics": True}),
        ("hicache_kv_dtype", 16),
        ("hicache_model_revision", ""),
        ("hicache_model_revision", 7),
        ("hicache_model_revision", "r" * 300),
    ],
)
def test_other_adapter_keys_of_the_wrong_type_are_config_errors(tmp_path: Path, key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key):
        _make({"hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}, key: value})


def test_null_means_not_given(tmp_path: Path) -> None:
    backend = _make(
        {
            "hicache_backend": "file",
            "hicache_options": {"root": str(tmp_path)},
            "hicache_extensions": None,
            "hicache_kv_dtype": None,
            "hicache_model_revision": None,
        }
    )
    backend.close()


def test_model_revision_separates_pages(tmp_path: Path) -> None:
    pool = MHAHost(8, 4, layer_num=1, head_num=1, head_dim=4)
    fill_random(pool, 5)
    base = {**ADAPTER_LOADER, "hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}}
    keys = page_hashes(list(range(8)), 4)
    idx = torch.arange(8)
    a = create({**base, "hicache_model_revision": "rev-a"}, pool, model="org/m")
    try:
        assert a.batch_set_v1(keys, idx) == [True, True]
        assert a.batch_exists(keys) == 2
        assert a.store.config.model_revision == "rev-a"
    finally:
        a.close()
    for other in ({**base, "hicache_model_revision": "rev-b"}, base):
        b = create(other, pool, model="org/m")
        try:
            assert b.batch_exists(keys) == 0
        finally:
            b.close()
    again = create({**base, "hicache_model_revision": "rev-a"}, pool, model="org/m")
    try:
        assert again.batch_exists(keys) == 2
    finally:
        again.close()


def test_a_revision_on_sglangs_storage_config_is_used(tmp_path: Path) -> None:
    """SGLang 0.5.23's HiCacheStorageConfig has no revision; a version that adds one is honoured,
    and ``hicache_model_revision`` wins over it."""

    @dataclasses.dataclass
    class WithRevision(HiCacheStorageConfig):
        revision: str | None = None

    pool = MHAHost(4, 4, layer_num=1, head_num=1, head_dim=4)
    extra = {**ADAPTER_LOADER, "hicache_backend": "file", "hicache_options": {"root": str(tmp_path)}}
    fields = dataclasses.asdict(sglang_config(extra, model="org/m"))
    for given, want in (({}, "from-sglang"), ({"hicache_model_revision": "explicit"}, "explicit")):
        cfg = WithRevision(**{**fields, "extra_config": {**extra, **given}}, revision="from-sglang")
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        try:
            backend.register_mem_pool_host(pool)
            assert backend.store.config.model_revision == want
        finally:
            backend.close()
