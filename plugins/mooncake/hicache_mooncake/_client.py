"""``StoreLink``: one backend instance's view of a (possibly shared) :class:`Connection`.

It adds the per-store behaviour: chunked batch calls (``max_keys_per_call`` <= 2048, because
larger TCP batches hit lane-queue rejections and a 60 s transfer timeout), put vs. upsert
(``overwrite``), the replica count, ownership of registered memory, and the handling of
corrupt objects: a get answered ``CHECKSUM_MISMATCH`` (-801, only when Mooncake's object
checksums are on) is a miss, counted in :attr:`StoreLink.integrity_errors`, logged and
force-removed so the key stops existing and the next backup rewrites it.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import eq
from typing import Any

from hicache_core import BackendIOError

from ._connection import Connection, acquire, process_checksum, release
from ._options import CHECKSUM_ENV, MooncakeOptions

__all__ = ["CHECKSUM_MISMATCH", "DOWN_CODES", "OBJECT_NOT_FOUND", "RPC_FAIL", "StoreLink"]

log = logging.getLogger("hicache.mooncake")

RPC_FAIL = -900
OBJECT_NOT_FOUND = -704
CHECKSUM_MISMATCH = -801  # get of an object whose bytes fail its CRC-64 (checksums on)
# codes meaning "the service did not answer": RPC_FAIL, and -1 (batch_is_exist in dummy mode)
DOWN_CODES = frozenset({RPC_FAIL, -1})
INFLIGHT_WAIT_S = 60.0  # bound on waiting for another thread's put of the same key


def _pick(values: Sequence[Any], sel: list[int] | None) -> list[Any]:
    """``values`` as a list, or only its items at positions ``sel``."""
    if sel is None:
        return values if type(values) is list else list(values)
    return [values[i] for i in sel]


def _listed(values: Sequence[Any]) -> list[Any]:
    return values if type(values) is list else list(values)


class StoreLink:
    """Batch operations of one store over its connection."""

    def __init__(self, options: MooncakeOptions, *, tp_rank: int = 0, ranks: int = 1) -> None:
        self.options = options
        self.conn: Connection = acquire(options, tp_rank, ranks)
        self.store = self.conn.store
        self.gate = self.conn.gate
        self.standalone = self.conn.standalone
        self.where = self.conn.where
        self._tag = f"{id(self):x}:"
        self._cfg = self.conn.module.ReplicateConfig()
        self._cfg.replica_num = options.replica_num
        self._closed = False
        self.integrity_errors = 0
        """Objects this store read that failed Mooncake's checksum (reported as misses, removed)."""
        self._count_lock = threading.Lock()
        self._check_checksum_setting()

    def _check_checksum_setting(self) -> None:
        """Say when ``options.checksum`` cannot take effect (the setting is process-wide)."""
        if self.standalone:
            if self.options.checksum:
                log.info(
                    "hicache mooncake: checksum=True in standalone mode: objects are verified only if "
                    "the mooncake_client at %s runs with %s=1 (its own setting, not this process's)",
                    self.options.client_server_address,
                    CHECKSUM_ENV,
                )
            return
        state = process_checksum()
        if state is not None and state != self.options.checksum:
            log.warning(
                "hicache mooncake: checksum=%s is not in effect: Mooncake reads %s once per process, "
                "when the first client is created, and this process's clients %s object checksums "
                "(the setting is process-wide: use the same checksum option for every store of the "
                "process, or set %s before it starts)",
                self.options.checksum,
                CHECKSUM_ENV,
                "verify" if state else "do not verify",
                CHECKSUM_ENV,
            )

    # ------------------------------------------------------------- memory
    def covers(self, ptr: int, size: int) -> bool:
        return self.conn.covers(ptr, size)

    def register(self, ptr: int, size: int, owner: str, holder: Any) -> bool:
        return self.conn.register(ptr, size, self._tag + owner, holder)

    def release(self, owner: str) -> None:
        self.conn.release(self._tag + owner)

    def alloc_shared(self, nbytes: int, owner: str, *, sizes_mapping: bool = False) -> Any:
        return self.conn.alloc_shared(nbytes, self._tag + owner, sizes_mapping=sizes_mapping)

    # ------------------------------------------------------------ batch calls
    def _one_call(self, n: int) -> bool:
        """Whether ``n`` keys go in one call right away: the usual batch, on a healthy connection."""
        return 0 < n <= self.options.max_keys_per_call and self.gate.down_since is None and self.conn.ready

    def _answer(self, codes: Sequence[int], n: int, what: str) -> list[int]:
        """Check one call's codes (one per key) and track the service's health from them."""
        if len(codes) != n:
            raise BackendIOError(f"mooncake: {what} returned {len(codes)} results for {n} keys")
        if codes[0] in DOWN_CODES and all(c in DOWN_CODES for c in codes):
            self.gate.mark_down(f"{what} failed with {sorted(set(codes))}")
        elif self.gate.down_since is not None:
            self.gate.mark_up()
        return codes if type(codes) is list else list(codes)

    def _run(self, n: int, call: Callable[[int, int], Sequence[int]], what: str) -> list[int]:
        """Run ``call(start, stop)`` over chunks of at most ``max_keys_per_call`` keys.

        Returns one code per key; keys never sent (outage) get ``RPC_FAIL``.
        """
        gate = self.gate
        if n == 0 or (gate.down_since is not None and gate.reachable() is not None):
            return [RPC_FAIL] * n
        if not self.conn.ready:  # standalone, no pool allocated through the store: connect now
            try:
                self.conn.ensure_setup()
            except BackendIOError as err:  # BackendTimeoutError included
                log.warning("hicache mooncake: %s failed: %s", what, err)
                return [RPC_FAIL] * n
        step = self.options.max_keys_per_call
        if n <= step:
            return self._answer(call(0, n), n, what)
        codes = [RPC_FAIL] * n
        for start in range(0, n, step):
            stop = min(n, start + step)
            part = call(start, stop)
            if len(part) != stop - start:
                raise BackendIOError(f"mooncake: {what} returned {len(part)} results for {stop - start} keys")
            codes[start:stop] = part
            if part[0] in DOWN_CODES and all(c in DOWN_CODES for c in part):
                gate.mark_down(f"{what} failed with {sorted(set(part))}")
                return codes
        gate.mark_up()
        return codes

    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = _listed(keys)
        codes = self._run(len(keys), lambda a, b: self.store.batch_is_exist(keys[a:b]), "batch_is_exist")
        return list(map(eq, codes, repeat(1)))

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Publish each ``(ptr, size)`` under its key. With ``overwrite`` existing keys are replaced."""
        fn = self.store.batch_upsert_from if self.options.overwrite else self.store.batch_put_from
        return self._put(fn, _listed(keys), ptrs, sizes)

    def _put(self, fn: Any, keys: list[str], ptrs: Sequence[Any], sizes: Sequence[Any]) -> list[bool]:
        """Put through ``fn`` the keys no other thread of this process is putting right now.

        Mooncake answers a put of a key whose first put is still in flight with 0 at once,
        although the object is not readable yet. Such keys are not sent again: this call waits
        for the other put to finish and then reports whether the object exists.
        """
        inflight = self.conn.inflight
        claim = inflight.claim(keys)
        n = len(claim.keys)
        try:
            if claim.sent is None and self._one_call(n):  # the usual put: one call, no list copies
                codes = self._answer(fn(keys, _listed(ptrs), _listed(sizes), self._cfg), n, "put")
            else:
                ks = claim.keys
                ps, ss = _pick(ptrs, claim.sent), _pick(sizes, claim.sent)
                codes = self._run(n, lambda a, b: fn(ks[a:b], ps[a:b], ss[a:b], self._cfg), "put")
        finally:
            inflight.release(claim)
        flags = list(map(eq, codes, repeat(0)))
        if claim.sent is None:
            return flags
        out = [False] * len(keys)
        for i, ok in zip(claim.sent, flags):
            out[i] = ok
        inflight.wait_others(claim, INFLIGHT_WAIT_S)
        busy = claim.busy
        for i, ok in zip(busy, self.exists([keys[i] for i in busy])):
            out[i] = ok
        return out

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Read each object into ``(ptr, size)``; True only when exactly ``size`` bytes arrived."""
        keys, ptrs, sizes = _listed(keys), _listed(ptrs), _listed(sizes)
        if len(set(keys)) != len(keys):
            return _by_occurrence(self.get, keys, ptrs, sizes)
        fn = self.store.batch_get_into
        n = len(keys)
        if self._one_call(n):  # the usual read: one call, no list copies
            codes = self._answer(fn(keys, ptrs, sizes), n, "batch_get_into")
        else:
            codes = self._run(n, lambda a, b: fn(keys[a:b], ptrs[a:b], sizes[a:b]), "batch_get_into")
        return self._read_flags(keys, codes, sizes)

    def _read_flags(self, keys: list[str], codes: list[int], sizes: Sequence[int]) -> list[bool]:
        """True where exactly the expected bytes arrived; corrupt objects are handled on the way."""
        if CHECKSUM_MISMATCH in codes:
            self._corrupt([k for k, c in zip(keys, codes) if c == CHECKSUM_MISMATCH])
        return list(map(eq, codes, sizes))

    def _corrupt(self, keys: list[str]) -> None:
        """Count, log and force-remove objects that failed their checksum."""
        bad = list(dict.fromkeys(keys))  # a key twice in one batch is one corrupt object
        with self._count_lock:
            self.integrity_errors += len(bad)
        for key in bad:
            log.warning(
                "hicache mooncake: corrupt object %r (CHECKSUM_MISMATCH from %s); reported as a miss "
                "and removed, so the next backup rewrites it",
                key,
                self.where,
            )
        step = self.options.max_keys_per_call
        for start in range(0, len(bad), step):
            part = bad[start : start + step]
            try:
                codes = list(self.store.batch_remove(part, True))
            except Exception as err:  # the read already failed safely; removal is best effort
                log.warning(
                    "hicache mooncake: batch_remove of %d corrupt object(s) failed: %s", len(part), err
                )
                continue
            failed = {k: c for k, c in zip(part, codes) if c not in (0, OBJECT_NOT_FOUND)}
            if failed:
                log.warning(
                    "hicache mooncake: could not remove corrupt object(s) %s; they stay reported as "
                    "existing until removed (hicache clear) or evicted",
                    failed,
                )

    def put_ranges(
        self, keys: Sequence[str], ptrs: Sequence[list[int]], sizes: Sequence[list[int]]
    ) -> list[bool]:
        """Publish objects assembled from several ranges each (strided page views)."""
        return self._put(self.store.batch_put_from_multi_buffers, _listed(keys), ptrs, sizes)

    def get_ranges(
        self, keys: Sequence[str], ptrs: Sequence[list[int]], sizes: Sequence[list[int]]
    ) -> list[bool]:
        keys = list(keys)
        if len(set(keys)) != len(keys):
            return _by_occurrence(self.get_ranges, keys, list(ptrs), list(sizes))
        fn = self.store.batch_get_into_multi_buffers
        codes = self._run(len(keys), lambda a, b: fn(keys[a:b], list(ptrs[a:b]), list(sizes[a:b])), "get")
        return self._read_flags(keys, codes, [sum(s) for s in sizes])

    def remove_prefix(self, prefix: str) -> int:
        """Remove (force) every object whose key starts with ``prefix``; returns the count."""
        why = self.gate.reachable()
        if why is not None:
            raise BackendIOError(f"mooncake: cannot clear, {why}")
        self.conn.ensure_setup()
        n = int(self.store.remove_by_regex("^" + re.escape(prefix), True))
        if n < 0:
            raise BackendIOError(f"mooncake: remove_by_regex failed with {n} on {self.where}")
        return n

    def close(self) -> None:
        """Release this store's registrations; the connection closes when unshared."""
        if self._closed:
            return
        self._closed = True
        self.conn.release(self._tag)
        release(self.conn)


def _by_occurrence(read: Any, keys: list[str], ptrs: list[Any], sizes: list[Any]) -> list[bool]:
    """``read`` a batch that names a key more than once: Mooncake's batch reads fill one buffer per
    distinct key (and report every position read), so the n-th occurrences of keys go in call n."""
    seen: dict[str, int] = {}
    rounds: list[list[int]] = []
    for i, key in enumerate(keys):
        n = seen[key] = seen.get(key, -1) + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)
    out = [False] * len(keys)
    for idx in rounds:
        flags = read([keys[i] for i in idx], [ptrs[i] for i in idx], [sizes[i] for i in idx])
        for i, ok in zip(idx, flags):
            out[i] = ok
    return out
