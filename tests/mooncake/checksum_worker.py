"""Child of test_checksum.py, run in a FRESH interpreter (Mooncake reads its checksum setting
once per process, when the first client is created).

``python checksum_worker.py MASTER on|off``: opens embedded stores on the given master with
``checksum=True`` (``on``) or the default (``off``), backs pages up, flips one byte in some
stored objects (in embedded mode the store's segment is this process's memory, so
``get_replica_desc(key)`` gives the stored bytes' address), reads everything back and prints
one JSON object with what happened.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import uuid
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from mooncake_helpers import embedded_options

import hicache_core as hc
from hicache_core import IoOp, PoolName, PoolTransfer

N = 12


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelname, record.getMessage()))


def _local(backend: Any) -> None:
    """Place this store's objects in this process's segment (other clients of the session's
    master have segments too, and Mooncake spreads objects over all of them)."""
    backend.link._cfg.preferred_segment = backend.link.store.get_hostname()


def _flip(raw: Any, key: str, stored: bytes, rng: random.Random) -> None:
    """Flip one bit of the stored object, after checking that its bytes are in this process."""
    desc = raw.get_replica_desc(key)[0].get_memory_descriptor().buffer_descriptor
    assert desc.size == len(stored)
    fd = os.open("/proc/self/mem", os.O_RDWR)  # an unmapped address is an error, not a crash
    try:
        here = os.pread(fd, desc.size, desc.buffer_address) == stored
        assert here, f"{key} is not stored in this process's segment ({desc.transport_endpoint})"
        off = desc.buffer_address + rng.randrange(desc.size)
        byte = os.pread(fd, 1, off)[0]
        os.pwrite(fd, bytes([byte ^ (1 << rng.randrange(8))]), off)
    finally:
        os.close(fd)


def _object(pool: hc.HostPool, page: int, comp: int) -> bytes:
    return bytes(pool.page_views([page])[0][comp].contiguous().numpy().tobytes())


def _controller(options: dict[str, Any], layout: str) -> hc.CacheController:
    kv = hc.MHAKVPool(2 * N, 4, 2, 2, 64, layout=layout, allocate=False)
    cfg = hc.StorageConfig(
        backend="mooncake",
        options=options,
        layout=layout,
        model_name=f"checksum-{uuid.uuid4().hex[:8]}",
        extensions=["metrics"],
    )
    return hc.CacheController(cfg, hc.HostPoolGroup(kv))


def _fill(pool: hc.HostPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for b in pool.buffers():
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def _same(pool: hc.HostPool, src: int, dst: int) -> bool:
    a, b = pool.page_views([src])[0], pool.page_views([dst])[0]
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _metric(ctl: hc.CacheController) -> Any:
    ext: Any = ctl.store.extensions["metrics"]
    if ext._backend is None:  # until Store binds extensions itself
        ext.bind_store(ctl.store)
    return ext.snapshot()["integrity_errors"]


def main(master: str, mode: str) -> dict[str, Any]:
    from hicache_mooncake._connection import process_checksum

    records = _Records()
    logging.getLogger("hicache.mooncake").addHandler(records)
    logging.getLogger("hicache.mooncake").setLevel(logging.INFO)
    rng = random.Random(5)
    out: dict[str, Any] = {"env_before": os.environ.get("MOONCAKE_STORE_CHECKSUM")}
    extra = {"checksum": True} if mode == "on" else {}
    opts = embedded_options(SimpleNamespace(address=master), global_segment_size="64MB", **extra)
    hashes = hc.page_hashes(list(range(4 * N)), 4)  # keys differ per run: model_name

    # page_first pool: zero-copy v2 (batch_get_into)
    with _controller(opts, "page_first") as ctl:
        pool = ctl.pools.anchor
        _local(ctl.store.backend)
        _fill(pool, 1)
        assert ctl.backup(hashes, range(N)).pages == N
        out["env_after_open"] = os.environ.get("MOONCAKE_STORE_CHECKSUM")
        out["process_checksum"] = process_checksum()
        backend: Any = ctl.store.backend
        raw = backend.link.store
        keys = ctl.store.page_keys(PoolName.KV, hashes)
        victims = sorted(rng.sample(range(N), 4))
        comps = [rng.randrange(2) for _ in victims]
        corrupted = [keys[i][c] for i, c in zip(victims, comps)]
        for i, c, key in zip(victims, comps, corrupted):
            _flip(raw, key, _object(pool, i, c), rng)
        transfer = PoolTransfer(PoolName.KV, tuple(range(N, 2 * N)), tuple(hashes), keys=tuple(keys))
        before = len(records.messages)
        (got,) = ctl.store.batch_io_v2(IoOp.GET, [transfer])
        warnings = [m for lvl, m in records.messages[before:] if lvl == "WARNING"]
        (exists,) = ctl.store.batch_io_v2(IoOp.EXISTS, [transfer])
        out["v2"] = {
            "pages": N,
            "victims": victims,
            "got": got,
            "returned_as_data": [i for i in range(N) if got[i] and not _same(pool, i, N + i)],
            "integrity_errors": backend.integrity_errors,
            "metric_integrity_errors": _metric(ctl),
            "warned_keys": [k for k in corrupted if any(repr(k) in w for w in warnings)],
            "exists_after": exists,
        }
        again = ctl.backup(hashes, range(N))
        for b in pool.buffers():
            b[N:].zero_()
        healed = ctl.prefetch(hashes, range(N, 2 * N))
        # Mooncake declares set_skips_existing (no existence pass, so `skipped` stays 0): count
        # the pages that were missing before this backup and are stored after it.
        (stored,) = ctl.store.batch_io_v2(IoOp.EXISTS, [transfer])
        out["v2"]["rewritten"] = sum(1 for i in range(N) if stored[i] and not exists[i])
        out["v2"]["backup_pages"] = again.pages
        out["v2"]["healed_pages"] = healed.pages
        out["v2"]["healed_exact"] = all(_same(pool, i, N + i) for i in range(N))
        out["v2"]["integrity_errors_end"] = backend.integrity_errors

    # layer_first pool: v1 with strided views (batch_get_into_multi_buffers)
    with _controller(opts, "layer_first") as ctl:
        pool = ctl.pools.anchor
        _local(ctl.store.backend)
        _fill(pool, 2)
        assert ctl.backup(hashes[:4], range(4)).pages == 4
        backend = ctl.store.backend
        keys = ctl.store.page_keys(PoolName.KV, hashes[:4])
        _flip(backend.link.store, keys[2][1], _object(pool, 2, 1), rng)
        flat = [k for ks in keys for k in ks]
        views = [v for page in pool.page_views(range(N, N + 4)) for v in page]
        flags = ctl.store.batch_io_v1(IoOp.GET, flat, views)
        out["v1"] = {
            "flags": flags,
            "integrity_errors": backend.integrity_errors,
            "exists_after": ctl.store.batch_io_v1(IoOp.EXISTS, flat),
        }

    # a store asking for the other setting in the same process is told it is process-wide
    before = len(records.messages)
    other = dict(opts, checksum=mode != "on", reuse_connection=False)
    with hc.open_store(hc.StorageConfig(backend="mooncake", options=other, model_name="other")):
        pass
    out["mismatch_warning"] = any(
        lvl == "WARNING" and "process-wide" in m for lvl, m in records.messages[before:]
    )
    return out


if __name__ == "__main__":
    from hicache_mooncake import close_idle_connections

    result = main(sys.argv[1], sys.argv[2])
    close_idle_connections()  # unmount the segment now: the master must not keep a dead one
    print(json.dumps(result))
