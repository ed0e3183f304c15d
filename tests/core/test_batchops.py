"""The C batch ops (``hicache_core._batchops``) give the Python hot path's answers.

Each native function answers only the usual case; for anything else it returns ``None`` (or
``False``) and the Python code that follows decides, raising the typed error. These tests hold
every native answer to the Python reference over valid, invalid and hostile inputs, and check
that the callers give the same results and errors with the extension on and off.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache_core import KeyFormatError, MHAKVPool, PoolName, _batch, _controller, _keys, _pools, _store
from hicache_core._keys import DefaultPageKeys, ValidHashes, _check_all, check_key, check_keys

NATIVE = _batch.NATIVE
needs_native = pytest.mark.skipif(NATIVE is None, reason="hicache_core._batchops is not built")
ALLOWED = string.ascii_letters + string.digits + "_-"


class Str(str):
    pass


class Int(int):
    pass


def _hash_cases() -> list[Any]:
    rng = random.Random(7)

    def word(n: int, first: str = string.ascii_letters + string.digits) -> str:
        return rng.choice(first) + "".join(rng.choice(ALLOWED) for _ in range(n - 1))

    good = [word(rng.randint(1, 128)) for _ in range(50)]
    cases: list[Any] = [[], (), good, tuple(good), ["a"], ["a" * 128], ["0-_"], ValidHashes(good)]
    for bad in ["", "a" * 129, "-a", "_a", "a.b", "a/b", "a b", "a\nb", "é", "aé", "a\x00", "..", "a" * 1000]:
        cases += [[*good[:3], bad], (bad,)]
    cases += [[*good[:2], 5], [None], [b"ab"], [Str("ab")], ["ab", Str("cd")]]
    cases += [iter(good), set(good[:1]), "abc", None, 3, {"a": 1}]
    return cases


def _python_valid(seq: Any) -> bool:
    """The reference: an exact list/tuple of exact str that the Python check accepts."""
    if type(seq) not in (list, tuple) or any(type(h) is not str for h in seq):
        return False
    try:
        _check_all(seq)
    except KeyFormatError:
        return False
    return True


@needs_native
@pytest.mark.parametrize("case", _hash_cases(), ids=lambda c: repr(c)[:40])
def test_valid_hashes_matches_the_python_check(case: Any) -> None:
    assert NATIVE is not None
    assert NATIVE.valid_hashes(case) is _python_valid(case)


def _python_index_tuple(seq: Any, limit: int) -> tuple[int, ...] | None:
    if type(seq) not in (list, tuple) or any(type(v) is not int for v in seq):
        return None
    if any(not 0 <= v < limit for v in seq):
        return None
    return tuple(seq)


@needs_native
@pytest.mark.parametrize(
    "seq",
    [
        [],
        (),
        [0, 1, 2],
        (3, 2, 1),
        list(range(1000)),
        [0, 10],
        [-1],
        [1, -5],
        [2**63],
        [-(2**70)],
        [True, 1],
        [Int(1)],
        [1.0],
        ["1"],
        [None],
        range(3),
        iter([1]),
        torch.tensor([1, 2]),
    ],
    ids=repr,
)
@pytest.mark.parametrize("limit", [0, 1, 10, 1000])
def test_index_tuple_matches_the_python_check(seq: Any, limit: int) -> None:
    assert NATIVE is not None
    got = NATIVE.index_tuple(seq, limit)
    assert got == _python_index_tuple(seq, limit)
    if got is not None:
        assert type(got) is tuple
        assert got is seq or type(seq) is list  # a tuple is returned as it is, a list copied once


@needs_native
def test_page_keys_builds_prefix_plus_hash_or_declines() -> None:
    assert NATIVE is not None
    hashes = ["ab", "c-d", "e" * 128]
    for prefixes in [(), ("p.",), ("p.", "q."), ("a", "b", "c", "d")]:
        want = [tuple(p + h for p in prefixes) for h in hashes]
        for seq in (hashes, tuple(hashes), ValidHashes(hashes)):
            assert NATIVE.page_keys(prefixes, seq) == want
    assert NATIVE.page_keys(("p.",), []) == []
    # anything unusual is declined (None), for the Python formula to handle
    for prefixes, seq in [
        (["p."], hashes),
        (("p.",), iter(hashes)),
        (("é",), hashes),
        (("p.",), ["é"]),
        (("p.",), [Str("ab")]),
        ((Str("p."),), hashes),
        (("p.",), [1]),
        ((1,), hashes),
    ]:
        assert NATIVE.page_keys(prefixes, seq) is None


@needs_native
def test_bool_flags_copies_an_exact_list_of_bools() -> None:
    assert NATIVE is not None
    flags = [True, False, True]
    copy = NATIVE.bool_flags(flags, 3)
    assert copy == flags and copy is not flags
    assert NATIVE.bool_flags([], 0) == []
    for obj, n in [(flags, 2), (flags, 4), ((True,), 1), ([1], 1), ([True, 0], 2), ([None], 1), (None, 0)]:
        assert NATIVE.bool_flags(obj, n) is None


def _without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (_keys, _pools, _store, _controller):
        monkeypatch.setattr(module, "NATIVE", None)


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as err:
        return type(err).__name__, str(err)


@needs_native
@pytest.mark.parametrize("case", _hash_cases(), ids=lambda c: repr(c)[:40])
def test_valid_hashes_and_page_keys_agree_with_the_extension_off(
    case: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if isinstance(case, Iterator):
        pytest.skip("a one-shot iterator: a second run would see it exhausted")
    keys = DefaultPageKeys(_Cfg())
    keys.hicache_register_pool(PoolName.KV, MHAKVPool(4, 1, 1, 1, 8, torch.uint8, allocate=False))

    def run() -> tuple[tuple[str, Any], tuple[str, Any]]:
        return _outcome(ValidHashes, case), _outcome(keys.hicache_page_keys, PoolName.KV, case)

    on = run()
    _without_native(monkeypatch)
    assert run() == on


@needs_native
@pytest.mark.parametrize(
    "indices", [[0, 1], (3, 2), [4], [-1], [True], [1.5], torch.tensor([1, 2]), range(2), []]
)
def test_index_tuple_agrees_with_the_extension_off(indices: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = MHAKVPool(4, 1, 1, 1, 8, torch.uint8, allocate=False)
    on = _outcome(pool._index_tuple, indices)
    _without_native(monkeypatch)
    assert _outcome(pool._index_tuple, indices) == on


class _Cfg:
    model_name = "m"
    kv_dtype = "bfloat16"
    layout = "page_first"
    tp_rank = 0
    tp_size = 1
    pp_rank = 0
    pp_size = 1
    attn_cp_rank = 0
    attn_cp_size = 1


def _key_cases() -> list[Any]:
    rng = random.Random(11)
    key_chars = ALLOWED + "."

    def key(n: int) -> str:
        out = rng.choice(string.ascii_letters + string.digits)
        while len(out) < n:
            c = rng.choice(key_chars)
            if not (c == "." and out[-1] == "."):
                out += c
        return out

    good = [key(rng.randint(1, 255)) for _ in range(50)]
    cases: list[Any] = [[], (), good, tuple(good), ["a"], ["a" * 255], ["a.b.c"], ["a."], ["0-_.x"]]
    for bad in [
        "",
        "a" * 256,
        ".a",
        "-a",
        "_a",
        "a..b",
        "a...",
        "a/b",
        "a b",
        "a\x00",
        "é",
        "a\nb",
        "..",
        "a\\b",
    ]:
        cases += [[*good[:3], bad], (bad,)]
    cases += [[*good[:2], 5], [None], [b"ab"], [Str("ab")], iter(good), "abc", None]
    return cases


@pytest.mark.parametrize("case", _key_cases(), ids=lambda c: repr(c)[:40])
def test_check_keys_is_check_key_on_every_key(case: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_keys`` accepts and rejects exactly what ``check_key`` per key does, with the
    extension (when built: ``valid_keys`` must agree too) and without it."""
    items = list(case) if isinstance(case, Iterator) else case

    def per_key(keys: Any) -> None:
        for k in keys:
            check_key(k)

    want = _outcome(per_key, items)
    if NATIVE is not None and type(items) in (list, tuple):
        exact = all(type(k) is str for k in items)
        assert NATIVE.valid_keys(items) is (exact and want[0] == "ok")
    assert _outcome(check_keys, items) == want
    _without_native(monkeypatch)
    assert _outcome(check_keys, items) == want
