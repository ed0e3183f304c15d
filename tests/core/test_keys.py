"""The default key scheme: isolation, sharing and file-name safety."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hicache_core as hc
from hicache_core import KeyScheme, PoolName
from hicache_core.paging import ValidHashes

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


# ---- batch checks: one pass over a joined batch must agree with the per-item checks ---------------

_CHARS = "ab09Z._-/\\ \0é"


class _StrSub(str):
    pass


def _mutate(base: str, data: st.DataObject) -> object:
    kind = data.draw(st.sampled_from(["same", "char", "shorter", "longer", "empty", "other", "sub"]))
    if kind == "same":
        return base
    if kind == "char" and base:
        i = data.draw(st.integers(0, len(base) - 1))
        return base[:i] + data.draw(st.sampled_from(_CHARS)) + base[i + 1 :]
    if kind == "shorter":
        return base[: data.draw(st.integers(0, len(base)))]
    if kind == "longer":
        return base + data.draw(
            st.text("ab0-." if data.draw(st.booleans()) else _CHARS, min_size=1, max_size=3)
        )
    if kind == "other":
        return data.draw(st.sampled_from([7, None, b"ab", base.encode()]))
    if kind == "sub":
        return _StrSub(base)
    return ""


def _verdict(check, items) -> bool:
    try:
        check(items)
    except hc.HiCacheError:
        return False
    return True


@settings(max_examples=400)
@given(
    base=st.text(_CHARS, max_size=8).map(lambda t: "k" + t)
    | st.sampled_from(["m.kv.k.all." + H, H, "a" * 128, "a.b" * 85]),
    size=st.integers(0, 12),
    data=st.data(),
)
def test_batch_checks_agree_with_per_item_checks(base: str, size: int, data: st.DataObject) -> None:
    """Mostly one common length (the fast path), with edits that change a length, a character,
    the type, or add ``..`` across items: a batch passes exactly when every item does."""
    items: list[object] = [base] * size
    for i in data.draw(st.lists(st.integers(0, size - 1), max_size=2)) if size else ():
        items[i] = _mutate(base, data)  # at most two items differ from the rest
    each_key = all(_verdict(hc.check_key, k) for k in items)
    each_hash = all(_verdict(hc.check_page_hash, h) for h in items)
    assert _verdict(hc.check_keys, items) == each_key
    assert _verdict(hc.check_keys, tuple(items)) == each_key
    assert _verdict(ValidHashes, items) == each_hash
    if each_hash:
        assert ValidHashes(items) == tuple(items)
