"""The default key scheme: isolation, sharing and file-name safety."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import hicache_core as hc
from hicache_core import KeyScheme, PoolName

H = "ab" * 32


def keys(pool: PoolName = PoolName.KV, comps=("k", "v"), replicated=False, **cfg):
    return KeyScheme(hc.StorageConfig(model_name=cfg.pop("model_name", "llama"), **cfg)).keys(
        pool, comps, replicated, [H]
    )[0]


def test_shape_and_safety() -> None:
    k, v = keys()
    assert k.endswith(".kv.k.tp0of1." + H) and v.endswith(".kv.v.tp0of1." + H)
    assert hc.check_key(k) == k


def test_mha_tp_ranks_are_isolated() -> None:
    assert set(keys(tp_rank=0, tp_size=2)).isdisjoint(keys(tp_rank=1, tp_size=2))


def test_mla_ranks_share_keys() -> None:
    a = keys(comps=("kv",), replicated=True, tp_rank=0, tp_size=4, is_mla_model=True)
    b = keys(comps=("kv",), replicated=True, tp_rank=3, tp_size=4, is_mla_model=True)
    assert a == b


def test_pp_and_cp_ranks_separate_even_replicated_data() -> None:
    a = keys(comps=("kv",), replicated=True, pp_rank=0, pp_size=2)
    b = keys(comps=("kv",), replicated=True, pp_rank=1, pp_size=2)
    c = keys(comps=("kv",), replicated=True, attn_cp_rank=1, attn_cp_size=2)
    assert len({a, b, c}) == 3


@pytest.mark.parametrize(
    "other",
    [
        {"model_name": "llama-70b"},
        {"kv_dtype": "fp8_e4m3"},
        {"layout": "layer_first"},
    ],
)
def test_model_dtype_layout_never_collide(other) -> None:
    assert set(keys()).isdisjoint(keys(**other))


def test_pools_and_draft_have_their_own_space() -> None:
    kv = keys(PoolName.KV)
    draft = keys(PoolName.DRAFT)
    mamba = keys(PoolName.MAMBA, ("temporal", "conv_0"))
    assert len(set(kv) | set(draft) | set(mamba)) == 6


def test_slug_collisions_are_separated_by_digest() -> None:
    # "org/model" and "org-model" slug identically; the digest keeps them apart.
    assert set(keys(model_name="org/model")).isdisjoint(keys(model_name="org-model"))


@given(st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=300))
def test_any_model_name_gives_safe_keys(model_name: str) -> None:
    # (control characters are refused by StorageConfig: tests/core/test_identity_fields.py)
    for key in keys(model_name=model_name):
        assert hc.check_key(key) == key
        assert "/" not in key and ".." not in key and "\0" not in key and len(key) <= 255


@pytest.mark.parametrize(
    "bad", ["", "../etc", "a/b", "a\\b", "x" * 129, "a\0b", "-lead", "a.b", " sp", 7, None, b"ab"]
)
def test_hostile_page_hashes_are_rejected(bad) -> None:
    scheme = KeyScheme(hc.StorageConfig())
    with pytest.raises(hc.KeyFormatError):
        scheme.keys(PoolName.KV, ("k",), False, [bad])


@pytest.mark.parametrize("bad", ["", "..", "a/../b", "a/b", "/abs", "a\0", "é", "x" * 256, ".hidden"])
def test_check_key_rejects_unsafe(bad: str) -> None:
    with pytest.raises(hc.KeyFormatError, match="unsafe storage key"):
        hc.check_key(bad)
