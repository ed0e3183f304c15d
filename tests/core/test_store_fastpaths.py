"""The store's trusted one-batch calls agree with the checked ones they shortcut.

``Store._trusted_transfer`` and ``Store._transfer_v2`` skip the argument checks the controller's
one-batch path makes redundant; what a plugin returns is still checked, with the same errors and
messages as ``page_keys`` / ``batch_io_v2``. ``TransferResult._trusted`` and
``HostPool._index_tuple`` build what their checked counterparts build.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import hicache_core as hc
from hicache_core import HitPolicy, IoOp, PoolName, PoolTransfer, TransferResult
from hicache_core._keys import ValidHashes

pytestmark = pytest.mark.usefixtures("memory_backends")

N = 3


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as err:
        return type(err).__name__, str(err)


class _Answer:
    """A lone ``hicache_batch_io_v2`` implementation answering what the test sets (or raising it)."""

    def __init__(self) -> None:
        self.answer: Any = None

    @hc.hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> Any:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class _ListKeys:
    """A key scheme returning lists, not tuples, per page (allowed: the store makes them tuples)."""

    @hc.hookimpl(tryfirst=True)
    def hicache_page_keys(self, pool_name: PoolName, page_hashes: Sequence[str]) -> list[list[str]]:
        return [[f"custom.{pool_name.value}.k.{h}", f"custom.{pool_name.value}.v.{h}"] for h in page_hashes]


def _store() -> hc.Store:
    store = hc.open_store(hc.StorageConfig(backend="memory", model_name="trusted"))
    store.register_pool(PoolName.KV, hc.MHAKVPool(8, 2, 1, 1, 4))
    return store


def _checked_transfer(store: hc.Store, hashes: ValidHashes, idx: tuple[int, ...]) -> PoolTransfer:
    return PoolTransfer(
        PoolName.KV, idx, hashes, HitPolicy.ALL_PAGES, keys=store.page_keys(PoolName.KV, hashes)
    )


def test_trusted_transfer_equals_the_checked_one_for_any_key_scheme() -> None:
    hashes, idx = ValidHashes(hc.page_hashes(list(range(2 * N)), 2)), (5, 1, 2)
    with _store() as store:
        assert store._default_keys_hook is not None  # the default scheme is called directly
        trusted = store._trusted_transfer(PoolName.KV, idx, hashes, HitPolicy.ALL_PAGES)
        assert trusted == _checked_transfer(store, hashes, idx)
        assert all(type(k) is tuple for k in trusted.keys)
        store.pm.register(_ListKeys())
        trusted = store._trusted_transfer(PoolName.KV, idx, hashes, HitPolicy.ALL_PAGES)
        assert store._default_keys_hook is None
        assert trusted == _checked_transfer(store, hashes, idx)
        assert trusted.keys[0][0].startswith("custom.kv.k.") and all(type(k) is tuple for k in trusted.keys)


@pytest.mark.parametrize(
    "answer",
    [
        None,
        [],
        [[True] * N, [True] * N],
        [None],
        [[True] * (N - 1)],
        [[1] * N],
        [[True, 0, False]],
        [(True, False, True)],
        [type("Flags", (list,), {})([True, True, False])],
        [[True, False, True]],
        ValueError("disk on fire"),
        hc.BackendIOError("typed already"),
    ],
    ids=repr,
)
def test_transfer_v2_checks_results_like_batch_io_v2(answer: Any) -> None:
    hashes, idx = ValidHashes(hc.page_hashes(list(range(2 * N)), 2)), (0, 1, 2)
    with _store() as store:
        store.pm.unregister(store.backend)
        plugin = _Answer()
        store.pm.register(plugin)
        plugin.answer = answer
        t = store._trusted_transfer(PoolName.KV, idx, hashes, HitPolicy.ALL_PAGES)
        for op in IoOp:
            checked = _outcome(lambda: list(store.batch_io_v2(op, [t])[0]))  # noqa: B023
            trusted = _outcome(store._transfer_v2, op, t)
            assert trusted == checked
            if trusted[0] == "ok":
                assert type(trusted[1]) is list
                assert trusted[1] is not answer[0], "never the backend's own list"


def test_trusted_result_equals_constructed() -> None:
    args = (2, {PoolName.KV: [True, True, False]}, None, 1, ("e",))
    trusted, built = TransferResult._trusted(*args), TransferResult(*args)
    assert trusted == built and repr(trusted) == repr(built) and vars(trusted) == vars(built)
    with pytest.raises(AttributeError):
        trusted.pages = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "indices",
    [
        [0, 1, 2],
        (7, 0, 3),
        [],
        [3, 3],
        [0, 8],
        [-1, 2],
        [True, 1],
        [1.0, 2],
        ["1"],
        range(3),
        "generator",
        [2**70],
    ],
    ids=repr,
)
def test_index_tuple_equals_checked_indices(indices: Any) -> None:
    pool = hc.MHAKVPool(8, 2, 1, 1, 4, allocate=False)

    def fresh() -> Any:  # a generator allows one pass: each call gets its own
        return (i for i in (1, 2)) if indices == "generator" else indices

    got = _outcome(pool._index_tuple, fresh())
    expected = _outcome(pool.check_indices, fresh())
    assert got == (expected[0], tuple(expected[1]) if expected[0] == "ok" else expected[1])
    if got[0] == "ok":
        assert all(type(i) is int for i in got[1])


def test_v1_pages_are_done_when_every_component_is() -> None:
    """The v1 path folds per-key flags into per-page flags (all, none, or a mix of components)."""
    from tests.support import membackend

    membackend.SHARED.clear()
    kv = hc.MHAKVPool(8, 2, 1, 1, 4, allocate=False)
    with hc.CacheController(hc.StorageConfig(backend="memory-nodraft", model_name="v1split"), kv) as ctl:
        assert ctl.io_path == "v1"
        for b in kv.buffers():
            b.random_(0, 256)
        hs = hc.page_hashes(list(range(10)), 2)
        first = ctl.backup(hs, range(5))
        assert first.per_pool[PoolName.KV] == [True] * 5 and first.skipped == 0
        keys = ctl.store.page_keys(PoolName.KV, hs)
        del membackend.SHARED[keys[1][1]]  # page 1 loses v, page 3 loses k
        del membackend.SHARED[keys[3][0]]
        assert ctl.query(hs).pages == 1
        read = ctl.prefetch(hs, range(5))
        assert read.pages == 1 and read.per_pool[PoolName.KV] == [True, False, True, False, True]
        again = ctl.backup(hs, range(5))  # pages 1 and 3 are written again, the rest skipped
        assert again.skipped == 3 and again.per_pool[PoolName.KV] == [True] * 5
        assert ctl.query(hs).pages == 5
        assert ctl.prefetch(hs, range(5)).per_pool[PoolName.KV] == [True] * 5
