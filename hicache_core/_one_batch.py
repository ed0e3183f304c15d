"""The controller's straight-line path for its most common request: the KV pool alone, one batch.

A backup or prefetch of at most ``batch_pages`` pages of the KV pool, with no other pool, no
draft offload and no call timeout, needs none of the general path's planning, chunking and
per-pool bookkeeping. Right after a batch has moved megabytes the CPU caches are cold, and
then every function the controller runs costs microseconds; this path runs a handful, with
the one call of the usual backup (a SET) and prefetch (a GET) written inline. Its
results are those of the general path (``CacheController._run_backup`` /
``_prefetch_direct``), which ``tests/core/test_one_batch.py`` checks against it.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import countOf

from ._keys import ValidHashes
from ._results import TransferResult, leading_run
from ._store import Store
from ._types import HitPolicy, IoOp, PoolName, PoolTransfer

__all__ = ["Failure", "backup", "prefetch"]

#: Records a failed backend call in ``errors`` and returns its flags: ``fail(errors, op, err, n)``.
Failure = Callable[[list[str], IoOp, Exception, int], list[bool]]


def backup(
    store: Store,
    hashes: ValidHashes,
    indices: tuple[int, ...],
    policy: HitPolicy,
    skips_existing: bool,
    fail: Failure,
) -> TransferResult:
    """Existence pass (unless the backend skips stored pages itself), then SET of the missing pages.

    ``indices``: the checked KV host pages, one per hash.
    """
    errors: list[str] = []
    t = store._trusted_transfer(PoolName.KV, indices, hashes, policy)  # keys resolved once
    if skips_existing:  # the usual backend: one SET, inlined (see the module docstring)
        try:
            flags = store._transfer_v2(IoOp.SET, t)  # a new list, never the backend's own object
        except Exception as err:
            flags = fail(errors, IoOp.SET, err, len(t))
        pages = len(flags) if all(flags) else leading_run(flags)
        return TransferResult._trusted(pages, {PoolName.KV: flags}, None, 0, tuple(errors))
    found = _io(store, IoOp.EXISTS, t, errors, fail)
    n = len(found)
    skipped = countOf(found, True)  # the store checked that these are bools
    if skipped == n:
        return TransferResult._trusted(n, {PoolName.KV: found}, None, skipped, tuple(errors))
    if skipped == 0:
        flags = _io(store, IoOp.SET, t, errors, fail)
    else:
        keep = [i for i, f in enumerate(found) if not f]
        todo = PoolTransfer._trusted(
            PoolName.KV,
            tuple(indices[i] for i in keep),
            hashes.pick(keep),
            policy,
            tuple(t.keys[i] for i in keep),
        )
        flags = found  # a list of our own: fill in the pages written
        for i, ok in zip(keep, _io(store, IoOp.SET, todo, errors, fail)):
            flags[i] = ok
    return _result(flags, skipped, errors)


def prefetch(
    store: Store, hashes: ValidHashes, indices: tuple[int, ...], policy: HitPolicy, fail: Failure
) -> TransferResult:
    """One GET; the leading run of pages read is the usable prefix. ``indices`` as for :func:`backup`."""
    errors: list[str] = []
    t = store._trusted_transfer(PoolName.KV, indices, hashes, policy)
    try:  # inlined _io and _result (see the module docstring)
        flags = store._transfer_v2(IoOp.GET, t)
    except Exception as err:
        flags = fail(errors, IoOp.GET, err, len(t))
    pages = len(flags) if all(flags) else leading_run(flags)
    return TransferResult._trusted(pages, {PoolName.KV: flags}, None, 0, tuple(errors))


def _io(store: Store, op: IoOp, transfer: PoolTransfer, errors: list[str], fail: Failure) -> list[bool]:
    try:
        return store._transfer_v2(op, transfer)  # a new list, never the backend's own object
    except Exception as err:
        return fail(errors, op, err, len(transfer))


def _result(flags: list[bool], skipped: int, errors: list[str]) -> TransferResult:
    pages = len(flags) if all(flags) else leading_run(flags)
    return TransferResult._trusted(pages, {PoolName.KV: flags}, None, skipped, tuple(errors))
