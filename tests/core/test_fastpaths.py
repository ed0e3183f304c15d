"""The controller's C-speed fast paths agree with the plain per-element code they shortcut.

Each ``_ref_*`` function below is the straightforward implementation (the code before the fast
paths); the fast versions must accept and reject exactly the same inputs, with the same error
types and messages, and return the same results.
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Generator, Iterable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hicache_core as hc
from hicache_core import HitPolicy, PoolName, PoolTransfer
from hicache_core._keys import (
    MAX_HASH_LEN,
    ValidHashes,
    _uniform_valid,
    check_page_hash,
    check_page_hashes,
)
from hicache_core._plan import Plan, assign, chunks, mark
from hicache_core._results import leading_run
from tests.support import membackend

_REF_HASHES_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}(?:\n[A-Za-z0-9][A-Za-z0-9_-]{0,127})*")


def _ref_check_page_hashes(page_hashes: Sequence[Any]) -> None:
    if not page_hashes:
        return
    try:
        joined = "\n".join(page_hashes)
    except TypeError:
        joined = ""
    if joined.count("\n") != len(page_hashes) - 1 or not _REF_HASHES_RE.fullmatch(joined):
        for h in page_hashes:
            check_page_hash(h)


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as err:
        return type(err).__name__, str(err)


# ------------------------------------------------------------------ page hashes
_chars = st.sampled_from([*"aZ09_-.\n /\\", "\0", "é", "\udc80", "\u0660", "²"])
_hash = st.text(_chars, max_size=6) | st.text(st.sampled_from("abcf019_-"), min_size=1, max_size=3)


@st.composite
def _uniform_batch(draw: Any) -> list[Any]:
    """Hashes of one length (the fast path's case), mostly valid, sometimes spoilt."""
    size = draw(st.sampled_from([1, 2, 5, 64, MAX_HASH_LEN, MAX_HASH_LEN + 1]))
    n = draw(st.integers(1, 6))
    alphabet = st.sampled_from("0123456789abcdefABCXYZ_-")
    out: list[Any] = [draw(st.text(alphabet, min_size=size, max_size=size)) for _ in range(n)]
    if draw(st.booleans()):
        i = draw(st.integers(0, n - 1))
        j = draw(st.integers(0, size - 1))
        bad = draw(_chars)  # same length, one character swapped (often for a forbidden one)
        out[i] = draw(
            _hash
            | st.integers()
            | st.none()
            | st.just(out[i] + "\n" + out[i])
            | st.just(out[i][:j] + bad + out[i][j + 1 :])
        )
    return out


@st.composite
def _resplit_batch(draw: Any) -> list[str]:
    """n hashes whose lengths add up to n * size, cut at arbitrary points: the hard case for a
    check that looks at the total length and at where the separators should be."""
    n = draw(st.integers(2, 5))
    size = draw(st.sampled_from([1, 2, 2, 3, 3, MAX_HASH_LEN]))
    alphabet = "ab9_-" if draw(st.booleans()) else "ab9-.\n/é"
    text = draw(st.text(st.sampled_from(alphabet), min_size=n * size, max_size=n * size))
    cuts = sorted(draw(st.lists(st.integers(0, n * size), min_size=n - 1, max_size=n - 1)))
    if draw(st.booleans()):
        cuts = [size * (i + 1) for i in range(n - 1)]  # uniform
    bounds = [0, *cuts, n * size]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


hash_batches = (
    _resplit_batch()
    | st.lists(_hash | st.integers() | st.none() | st.binary(max_size=3), max_size=5)
    | _uniform_batch()
)


@settings(max_examples=600, deadline=None)
@given(hash_batches)
def test_page_hash_check_matches_reference(batch: list[Any]) -> None:
    expected = _outcome(_ref_check_page_hashes, batch)
    assert _outcome(check_page_hashes, batch) == expected
    assert _outcome(check_page_hashes, tuple(batch)) == expected
    made = _outcome(ValidHashes, batch)
    assert made[0] == expected[0] and (made[0] != "ok" or made[1] == tuple(batch))
    if made[0] != "ok":
        assert made[1] == expected[1]


@settings(max_examples=1000, deadline=None)
@given(_uniform_batch() | _resplit_batch() | _resplit_batch())
def test_uniform_fast_path_is_sound_and_taken(batch: list[Any]) -> None:
    if not all(isinstance(h, str) for h in batch):
        return
    joined = "\n".join(batch)
    fast = _uniform_valid(joined, len(batch))
    valid = _outcome(_ref_check_page_hashes, batch)[0] == "ok"
    assert not fast or valid  # never accepts what the reference rejects
    if valid and len({len(h) for h in batch}) == 1:
        assert fast  # the usual batch really takes the fast path


def test_uniform_fast_path_rejects_moved_separators() -> None:
    # Same total length and newline count as two 2-character hashes, but not split 2 + 2.
    assert not _uniform_valid("a\nbcd", 2)
    assert not _uniform_valid("abc\nd", 2)
    assert not _uniform_valid("a\n\nb", 2) and not _uniform_valid("_a\nbc", 2)
    assert not _uniform_valid("ab\nc\n-de", 3)  # starts every 3 chars look fine, "-de" does not
    assert not _uniform_valid("ab\n\ncdef", 3) and _uniform_valid("ab\ncd\nee", 3)
    assert _uniform_valid("ab\ncd", 2) and _uniform_valid("a-\nc_", 2)


@pytest.mark.parametrize(("n", "size"), [(1, 3), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2)])
def test_uniform_fast_path_exhaustively_small(n: int, size: int) -> None:
    """Every text of n * size characters over a letter, '-', '.' and a newline, cut anywhere."""
    for chars in itertools.product("a-.\n", repeat=n * size):
        text = "".join(chars)
        for cuts in itertools.combinations_with_replacement(range(n * size + 1), n - 1):
            batch = [text[a:b] for a, b in itertools.pairwise([0, *cuts, n * size])]
            valid = _outcome(_ref_check_page_hashes, batch)[0] == "ok"
            fast = _uniform_valid("\n".join(batch), n)
            assert fast == (valid and len({len(h) for h in batch}) == 1), batch
            assert _outcome(check_page_hashes, batch) == _outcome(_ref_check_page_hashes, batch)


def test_valid_hashes_are_checked_once_and_only_when_exact() -> None:
    h = hc.page_hashes(list(range(12)), 4)
    v = ValidHashes(h)
    assert v == tuple(h) and type(v.pick([2, 0])) is ValidHashes and v.pick([2, 0]) == (h[2], h[0])
    with pytest.raises(hc.KeyFormatError, match="invalid page hash"):
        ValidHashes([*h, "../etc"])

    class Sneaky(ValidHashes):
        def __getitem__(self, i: Any) -> Any:
            return "../etc"

    sneaky = Sneaky(h)
    with pytest.raises(hc.KeyFormatError):
        sneaky.pick([0])  # a subclass is never trusted
    check_page_hashes(v)  # trusted: no exception, no work


def test_store_page_keys_still_validates_every_other_caller(memory_backends) -> None:
    kv = hc.MHAKVPool(4, 4, 1, 1, 8, allocate=False)
    with hc.CacheController(hc.StorageConfig(backend="memory"), kv) as ctl:
        h = hc.page_hashes(list(range(8)), 4)
        assert ctl.store.page_keys(PoolName.KV, h) == ctl.store.page_keys(PoolName.KV, ValidHashes(h))
        for bad in (["../x"], [*h, "a b"], ("x" * 129,), [h[0], 7]):
            with pytest.raises(hc.KeyFormatError):
                ctl.store.page_keys(PoolName.KV, bad)


# ----------------------------------------------------------------- host indices
def _ref_check_indices(pool: hc.HostPool, indices: Any) -> list[int]:
    tolist = getattr(indices, "tolist", None)
    try:
        out = [operator.index(i) for i in (tolist() if tolist is not None else indices)]
    except TypeError:
        raise hc.BatchShapeError(
            f"host page indices must be integers (a sequence of int or an integer tensor), got {indices!r:.80}"
        ) from None
    if out and (min(out) < 0 or max(out) >= pool.num_pages):
        bad = next(i for i in out if i < 0 or i >= pool.num_pages)
        raise hc.BatchShapeError(
            f"host page index {bad} is out of range for {type(pool).__name__} with "
            f"{pool.num_pages} pages (valid: 0..{pool.num_pages - 1})"
        )
    return out


_index = st.one_of(
    st.integers(-3, 40),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=False, max_value=40),
    st.sampled_from(["1", None, b"\x01", np.int64(3), np.int32(-1), np.float64(2.0), np.bool_(True)]),
    st.just(torch.tensor(5)),
)


def _containers(values: list[Any]) -> Iterable[Any]:
    yield values
    yield tuple(values)
    yield (v for v in values)
    if all(type(v) is int and -(2**62) < v < 2**62 for v in values):
        yield torch.tensor(values, dtype=torch.int64)
        yield np.array(values, dtype=np.int64)
        yield range(len(values))
        yield range(-1, len(values) - 1)


@settings(max_examples=400, deadline=None)
@given(st.lists(_index, max_size=8) | st.lists(st.integers(0, 31), max_size=200))
def test_check_indices_matches_reference(values: list[Any]) -> None:
    pool = hc.MHAKVPool(32, 4, 1, 1, 8, allocate=False)
    for container in _containers(values):
        if hasattr(container, "__next__"):  # a generator: one pass each
            fresh = list(values)
            expected = _outcome(_ref_check_indices, pool, iter(fresh))
            got = _outcome(pool.check_indices, iter(fresh))
            assert (got[0], got[0] == "ok" and got[1]) == (expected[0], expected[0] == "ok" and expected[1])
            continue
        expected = _outcome(_ref_check_indices, pool, container)
        got = _outcome(pool.check_indices, container)
        assert got == expected, container
        if got[0] == "ok":
            assert all(type(i) is int for i in got[1])


def test_check_indices_large_batches_and_messages() -> None:
    pool = hc.MHAKVPool(1000, 4, 1, 1, 8, allocate=False)
    big = list(range(999, -1, -1))
    assert pool.check_indices(big) == big and pool.check_indices(big) is not big
    for bad in ([*big, 1000], [5, -1, *big]):
        assert _outcome(pool.check_indices, bad) == _outcome(_ref_check_indices, pool, bad)


# --------------------------------------------------------- flags and bookkeeping
def _ref_leading_run(flags: Iterable[Any]) -> int:
    for i, ok in enumerate(flags):
        if not ok:
            return i
    return len(flags)  # type: ignore[arg-type]


_flag = st.sampled_from([True, False, 1, 0, None, "", "x", 0.0, [], [0]])


@given(st.lists(_flag, max_size=12))
def test_leading_run_matches_reference(flags: list[Any]) -> None:
    for container in (flags, tuple(flags)):
        assert leading_run(container) == _ref_leading_run(container)
    if not all(flags):  # an iterator stops at the first falsy entry, like before
        assert leading_run(iter(flags)) == _ref_leading_run(iter(flags))


def _ref_mark(out: list[bool], base: int, positions: Sequence[int], ok: Sequence[bool]) -> None:
    for pos, v in zip(positions, ok):
        if v:
            out[pos - base] = True


@st.composite
def _marking(draw: Any) -> tuple[list[bool], int, list[int], list[bool]]:
    size = draw(st.integers(0, 12))
    base = draw(st.integers(0, 5))
    out = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    chosen = sorted(draw(st.sets(st.integers(0, max(size - 1, 0)), max_size=size)) if size else [])
    if draw(st.booleans()) and size:  # a run of consecutive positions (the usual case)
        lo = draw(st.integers(0, size - 1))
        chosen = list(range(lo, draw(st.integers(lo, size))))
    positions = [p + base for p in chosen]
    ok = draw(st.lists(st.booleans(), min_size=len(positions), max_size=len(positions) + 1))
    if draw(st.booleans()):
        ok = ok[: len(positions)]
    return out, base, positions, ok


@given(_marking())
def test_mark_and_assign_match_reference(case: tuple[list[bool], int, list[int], list[bool]]) -> None:
    out, base, positions, ok = case
    want, got = list(out), list(out)
    _ref_mark(want, base, positions, ok)
    mark(got, base, positions, ok)
    assert got == want and len(got) == len(out)
    want, got = [False] * (len(out) + base), [False] * (len(out) + base)
    for pos, v in zip(positions, ok):
        want[pos] = v
    assign(got, positions, ok)
    assert got == want


@given(st.lists(st.booleans(), max_size=10), st.integers(0, 3))
def test_plan_missing_matches_reference(found: list[bool], offset: int) -> None:
    pool = hc.MHAKVPool(32, 4, 1, 1, 8, allocate=False)
    positions = [offset + i for i in range(len(found))]
    indices = [31 - p for p in positions]
    plan = Plan(PoolName.KV, pool, positions, indices)
    sel = [i for i, e in enumerate(found) if not e]
    got = plan.missing(found)
    if not sel:
        assert got is None
    else:
        assert got is not None and got.name is PoolName.KV and got.pool is pool
        assert got.positions == [positions[i] for i in sel] and got.indices == [indices[i] for i in sel]


@given(st.integers(0, 50), st.integers(1, 20))
def test_chunks_match_reference(n: int, step: int) -> None:
    assert chunks(n, step) == [(s, min(s + step, n)) for s in range(0, n, step)]


def test_trusted_pool_transfer_equals_constructed() -> None:
    keys = ((f"ns.kv.k.{i}", f"ns.kv.v.{i}") for i in range(3))
    args = (PoolName.KV, (4, 5, 6), ("a", "b", "c"), HitPolicy.ALL_PAGES, tuple(keys))
    trusted, built = PoolTransfer._trusted(*args), PoolTransfer(*args)
    assert trusted == built and len(trusted) == 3
    assert [type(getattr(trusted, f)) for f in ("pool", "host_indices", "keys")] == [PoolName, tuple, tuple]


# ------------------------------------------------------------------- controller
def test_partial_existence_writes_exactly_the_missing_pages(memory_backends) -> None:
    kv = hc.MHAKVPool(32, 4, 1, 1, 8, allocate=False)
    cfg = hc.StorageConfig(backend="memory", batch_pages=4)
    with hc.CacheController(cfg, kv) as ctl:
        for b in kv.buffers():
            b.random_(0, 256)
        hs = hc.page_hashes(list(range(40)), 4)
        assert ctl.backup([hs[i] for i in (1, 2, 6, 8)], [1, 2, 6, 8]).pages == 4
        backend = ctl.store.backend
        backend.calls.clear()
        res = ctl.backup(hs, range(10))
        sets = [c[2] for c in backend.calls if c[1] == "set"]
        assert sets == [2, 3, 1]  # chunk [0,4): 0,3; [4,8): 4,5,7; [8,10): 9
        assert res.skipped == 4 and res.pages == 10 and res.per_pool[PoolName.KV] == [True] * 10
        assert ctl.query(hs).pages == 10 and ctl.prefetch(hs, range(10, 20)).pages == 10


def test_keys_resolve_once_per_page_and_operation(memory_backends) -> None:
    kv = hc.MHAKVPool(32, 4, 1, 1, 8, allocate=False)
    with hc.CacheController(hc.StorageConfig(backend="memory", batch_pages=4), kv) as ctl:
        seen: list[tuple[str, int]] = []

        class Spy:  # sees every hicache_page_keys call, whichever store method makes it
            @hc.hookimpl(wrapper=True)
            def hicache_page_keys(self, page_hashes: Sequence[str]) -> Generator[None, Any, Any]:
                seen.append((type(page_hashes).__name__, len(page_hashes)))
                return (yield)

        ctl.store.pm.register(Spy())
        hs = hc.page_hashes(list(range(40)), 4)
        ctl.backup(hs, range(10))  # exists + set per chunk, keys resolved once per chunk
        assert seen == [("ValidHashes", 4), ("ValidHashes", 4), ("ValidHashes", 2)]
        seen.clear()
        ctl.backup(hs[:3], range(3))  # one chunk: the whole request at once
        assert seen == [("ValidHashes", 3)]
    assert membackend.SHARED


# ------------------------------------------------------------------ page keys
def test_page_keys_come_from_the_validated_items() -> None:
    """A sequence that yields other items on a second pass cannot smuggle an unchecked hash."""
    from hicache_core._keys import DefaultPageKeys, KeyScheme

    class Shifty(list):  # type: ignore[type-arg]
        passes = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            Shifty.passes += 1
            return iter(["../../etc/passwd"] if Shifty.passes > 1 else list.__iter__(self))

    cfg = hc.StorageConfig(backend="file", model_name="keys-ref")
    keys = KeyScheme(cfg).keys(PoolName.KV, ["k"], False, Shifty(["abc", "def"]))
    assert [k[0].rsplit(".", 1)[1] for k in keys] == ["abc", "def"]
    Shifty.passes = 0
    default = DefaultPageKeys(cfg)
    default.hicache_register_pool(PoolName.KV, hc.MHAKVPool(2, 4, 1, 1, 8, allocate=False))
    keys = default.hicache_page_keys(PoolName.KV, Shifty(["abc", "def"]))
    assert all(".." not in k for ks in keys for k in ks)
    assert [ks[0].rsplit(".", 1)[1] for ks in keys] == ["abc", "def"]
