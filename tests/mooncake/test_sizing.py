"""Standalone sizing end to end: pool memory comes from a real mooncake_client's shared pool."""

from __future__ import annotations

from typing import Any

import torch
from mooncake_helpers import make_config, make_group, rand_hashes, roundtrip

from hicache_core import CacheController, HostPoolGroup, MambaPool, MLAKVPool, PoolName
from hicache_core.sizing import standalone_required_bytes


def _shared_regions(ctl: CacheController) -> list[Any]:
    link = ctl.store.backend.link
    return [r for r in link.conn._regions if r.permanent and link._tag + "alloc" in r.owners]


def test_exact_small_pools_in_shared_memory(standalone_opts: dict[str, Any]) -> None:
    kv = MLAKVPool(1, 1, 1, 128, torch.uint8, allocate=False)  # 128 B
    mamba = MambaPool(1, 1, (64,), [(32,)], torch.uint8, torch.uint8, allocate=False)  # 64 B + 32 B
    group = HostPoolGroup(kv, {PoolName.MAMBA: mamba})
    planned = standalone_required_bytes(group)
    assert planned == group.unallocated_nbytes  # planned pools count their (64 B aligned) regions
    with CacheController(make_config(standalone_opts, "mla"), group) as ctl:
        (region,) = _shared_regions(ctl)
        assert region.end - region.start == planned
        assert standalone_required_bytes(group) == 224  # the unique buffers: 128 + 64 + 32
        for pool in group.values():
            for buf in pool.buffers():
                assert region.start <= buf.data_ptr() and buf.data_ptr() + buf.numel() <= region.end
        for buf in (*kv.buffers(), *mamba.buffers()):
            buf.fill_(9)
        h = rand_hashes(1)
        assert ctl.backup(h, [0], {PoolName.MAMBA: [0]}).ok
        for buf in (*kv.buffers(), *mamba.buffers()):
            buf.zero_()
        assert ctl.prefetch(h, [0], {PoolName.MAMBA: [0]}).pages == 1
        assert all(bool((b == 9).all()) for b in (*kv.buffers(), *mamba.buffers()))


def test_hybrid_group_sized_and_zero_copy(standalone_opts: dict[str, Any]) -> None:
    group = make_group("hybrid")
    planned = standalone_required_bytes(group)
    with CacheController(make_config(standalone_opts, "hybrid"), group) as ctl:
        (region,) = _shared_regions(ctl)
        assert region.end - region.start == planned
        backend = ctl.store.backend
        assert all(p.direct for p in backend._pools.values())  # every pool registered: zero copy
        assert standalone_required_bytes(group) <= planned
        roundtrip(ctl, group)


def test_setup_dummy_sized_by_planned_kv_mamba_group(standalone_opts: dict[str, Any]) -> None:
    """The deferred setup_dummy announces standalone_required_bytes of the planned pools."""
    group = make_group("mamba")  # KV + Mamba, planned (allocate=False)
    planned = standalone_required_bytes(group)
    opts = {**standalone_opts, "reuse_connection": False, "mem_pool_size": 7 << 20}
    with CacheController(make_config(opts, "mamba"), group) as ctl:
        conn = ctl.store.backend.link.conn
        assert conn.ready
        assert conn.setup_size == planned  # the real call's argument, not the option
        assert conn.setup_size != opts["mem_pool_size"]
        (region,) = _shared_regions(ctl)
        assert region.end - region.start == planned
        roundtrip(ctl, group)


def test_setup_dummy_option_fallback_without_store_allocation(standalone_opts: dict[str, Any]) -> None:
    """Pools allocated outside the store: setup_dummy runs at registration with mem_pool_size."""
    group = make_group("mamba", allocate=True)
    opts = {**standalone_opts, "reuse_connection": False, "mem_pool_size": 7 << 20}
    with CacheController(make_config(opts, "mamba"), group) as ctl:
        conn = ctl.store.backend.link.conn
        assert conn.setup_size == 7 << 20
        assert not _shared_regions(ctl)
