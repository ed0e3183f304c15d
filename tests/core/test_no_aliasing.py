"""Arguments that could make two things share one place: identity fields (the key namespace)
and a load's host slots."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import hicache_core as hc
from hicache_core.paging.keys import KeyScheme


@pytest.mark.parametrize("field", ["model_name", "kv_dtype", "model_revision"])
@pytest.mark.parametrize("bad", ["a\0b", "a\nb", "a\tb", "\x7f", "a\x85b"])
def test_identity_fields_refuse_control_characters(field: str, bad: str) -> None:
    with pytest.raises(hc.ConfigError, match=field) as info:
        hc.StorageConfig(**{field: bad})
    assert isinstance(info.value, ValueError)
    assert "printable" in str(info.value)


def test_printable_unicode_names_are_accepted() -> None:
    cfg = hc.StorageConfig(
        model_name="Llama-3 8B/instruct ünïcode", kv_dtype="fp8_e4m3", model_revision="v1 2"
    )
    assert cfg.model_name == "Llama-3 8B/instruct ünïcode"


def _scheme(model: str, dtype: str, revision: str | None = None) -> KeyScheme:
    cfg = SimpleNamespace(
        model_name=model,
        kv_dtype=dtype,
        layout=hc.Layout.PAGE_FIRST,
        model_revision=revision,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
    )
    return KeyScheme(cfg)


def test_nul_in_fields_cannot_alias_another_namespace() -> None:
    # Built around StorageConfig (which refuses these): the key scheme itself keeps them apart.
    a = _scheme("m\0bfloat16", "fp8")
    b = _scheme("m", "bfloat16\0fp8")
    assert a.namespace != b.namespace
    # A config without NUL keeps its exact historical namespace.
    plain = KeyScheme(hc.StorageConfig(model_name="m", kv_dtype="fp8"))
    assert plain.namespace == _scheme("m", "fp8").namespace
    assert _scheme("m", "fp8").namespace != _scheme("m", "fp8", "null").namespace


def test_a_load_refuses_a_slot_given_twice(tmp_path) -> None:
    kv = hc.MHAKVPool(num_pages=8, page_size=4, num_layers=1, num_heads=1, head_dim=8)
    ctl = hc.CacheController(
        hc.StorageConfig(backend="file", options={"root": str(tmp_path)}), hc.HostPoolGroup(kv)
    )
    try:
        hashes = hc.page_hashes(list(range(8)), page_size=4)
        for slot, value in ((0, 1), (1, 2)):
            for view in kv.page_views([slot])[0]:
                view.fill_(value)
        assert ctl.backup(hashes, [0, 1]).pages == 2
        assert ctl.backup(hashes, [0, 0]).pages == 2  # a store from one slot twice is fine
        with pytest.raises(hc.BatchShapeError, match="slot 5 appears twice") as info:
            ctl.prefetch(hashes, [5, 5])
        assert isinstance(info.value, ValueError)
        with pytest.raises(hc.BatchShapeError, match="appears twice"):
            ctl.prefetch_async(hashes, [6, 6])
        assert ctl.prefetch(hashes, [5, 6]).pages == 2
        assert int(kv.page_views([5])[0][0][0]) == 1 and int(kv.page_views([6])[0][0][0]) == 2
    finally:
        ctl.close()


def test_default_kv_dtype_is_the_kv_pools_dtype(tmp_path: Path) -> None:
    """float16 and bfloat16 pages have the same size: two controllers that both leave kv_dtype
    unset never read each other's pages as their own (the namespace names the pool's dtype)."""
    import torch

    cfg = hc.StorageConfig(backend="file", options={"root": str(tmp_path)}, model_name="m")
    hashes = hc.page_hashes(list(range(16)), 4)
    bf16 = hc.MHAKVPool(4, 4, 1, 1, 8, dtype=torch.bfloat16)
    with hc.CacheController(cfg, bf16) as ctl:
        assert ctl.config.kv_dtype == "bfloat16"
        assert ctl.backup(hashes, [0, 1, 2, 3]).pages == 4
    f16 = hc.MHAKVPool(4, 4, 1, 1, 8, dtype=torch.float16)
    with hc.CacheController(cfg, f16) as ctl:
        assert ctl.config.kv_dtype == "float16"
        assert ctl.query(hashes).pages == 0 and ctl.prefetch(hashes, [0, 1, 2, 3]).pages == 0
    # a value the config sets is the operator's label, kept as given
    labelled = cfg.model_copy(update={"kv_dtype": "fp8_e4m3"})
    u8 = hc.MHAKVPool(4, 4, 1, 1, 16, dtype=torch.uint8)
    with hc.CacheController(hc.StorageConfig(**labelled.model_dump()), u8) as ctl:
        assert ctl.config.kv_dtype == "fp8_e4m3"
