"""Helpers shared by the Mooncake tests (and the two-process worker): pool groups, data, checks."""

from __future__ import annotations

import random
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from hicache_core import (
    CacheController,
    HostPoolGroup,
    IndexerPool,
    MambaPool,
    MHAKVPool,
    MLAKVPool,
    PoolName,
    StorageConfig,
    page_hashes,
)

PAGE_SIZE = 4
KINDS = ("mha", "mla", "mamba", "indexer", "draft", "hybrid")


def make_group(
    kind: str, *, pages: int = 24, layout: str = "page_first", allocate: bool = False
) -> HostPoolGroup:
    """A pool group for ``kind``; ``allocate=False`` lets the controller take memory from the store."""
    kw: dict[str, Any] = {"layout": layout, "allocate": allocate}
    mla = kind in ("mla", "indexer")
    kv = (
        MLAKVPool(pages, PAGE_SIZE, 3, 24, torch.bfloat16, **kw)
        if mla
        else MHAKVPool(pages, PAGE_SIZE, 3, 2, 16, torch.bfloat16, **kw)
    )
    extras: dict[PoolName | str, Any] = {}
    if kind in ("mamba", "hybrid"):
        extras[PoolName.MAMBA] = MambaPool(6, 3, (2, 8), [(4, 3), (5,)], **kw)
    if kind == "indexer":
        extras[PoolName.INDEXER] = IndexerPool(pages, PAGE_SIZE, 3, 20, **kw)
    if kind in ("draft", "hybrid"):
        extras[PoolName.DRAFT] = MHAKVPool(pages, PAGE_SIZE, 1, 2, 16, torch.bfloat16, **kw)
    return HostPoolGroup(kv, extras)


def make_config(options: dict[str, Any], kind: str = "mha", **kw: Any) -> StorageConfig:
    kw.setdefault("model_name", f"test-{kind}-{uuid.uuid4().hex[:8]}")
    return StorageConfig(backend="mooncake", options=options, is_mla_model=kind in ("mla", "indexer"), **kw)


def fill(group: HostPoolGroup, seed: int) -> None:
    """Deterministic random bytes in every buffer of every pool."""
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(group, key=lambda p: p.value):
        for buf in group[name].buffers():
            buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


def zero(group: HostPoolGroup) -> None:
    for pool in group.values():
        for buf in pool.buffers():
            buf.zero_()


def snapshot(group: HostPoolGroup) -> dict[PoolName, list[torch.Tensor]]:
    return {n: [b.clone() for b in p.buffers()] for n, p in group.items()}


def rand_hashes(n: int, seed: int | None = None) -> list[str]:
    rng = random.Random(seed if seed is not None else uuid.uuid4().int)
    return page_hashes([rng.randrange(1 << 31) for _ in range(n * PAGE_SIZE)], PAGE_SIZE)


def page(group: HostPoolGroup, name: PoolName, idx: int) -> list[torch.Tensor]:
    """All components of one page (layout independent: via page views)."""
    return [v.contiguous() for v in group[name].page_views([idx])[0]]


def expect_same_pages(
    ref: dict[PoolName, list[torch.Tensor]],
    group: HostPoolGroup,
    name: PoolName,
    src_idx: list[int],
    dst_idx: list[int],
) -> None:
    """Page ``src_idx[i]`` of the snapshot equals page ``dst_idx[i]`` of the live pool, byte for byte."""
    pool = group[name]
    for s, d in zip(src_idx, dst_idx):
        for comp, buf, ref_buf in zip(pool.components, pool.buffers(), ref[name]):
            if pool.layout.value == "page_first":
                got, want = buf[d], ref_buf[s]
            else:
                got, want = buf[:, d], ref_buf[:, s]
            assert torch.equal(got, want), f"pool {name.value} component {comp}: page {s} -> slot {d} differs"


def roundtrip(ctl: CacheController, group: HostPoolGroup, n: int = 12, seed: int = 1) -> None:
    """Back up ``n`` pages from some slots, wipe, query, prefetch into OTHER slots, compare bytes."""
    fill(group, seed)
    ref = snapshot(group)
    hashes = rand_hashes(n)
    total = group.anchor.num_pages
    src = list(range(n))[::-1]  # reversed slots
    dst = [total - 1 - i for i in range(n)]  # other slots
    mamba = PoolName.MAMBA in group
    extra_src: Mapping[PoolName | str, Any] | None = {PoolName.MAMBA: [0, 1]} if mamba else None
    extra_dst: Mapping[PoolName | str, Any] | None = {PoolName.MAMBA: [4, 5]} if mamba else None
    res = ctl.backup(hashes, src, extra_src)
    assert res.errors == () and res.ok and res.pages == n, res
    if ctl.draft_enabled:
        assert res.draft == [True] * n, res
    again = ctl.backup(hashes, src, extra_src)
    # Mooncake skips stored pages itself (capabilities.set_skips_existing): no existence pass,
    # so nothing is counted as skipped; with `overwrite` the controller checks and skips them.
    skips = 0 if ctl.store.capabilities.set_skips_existing else n
    assert again.ok and again.pages == n and again.skipped >= skips, again
    zero(group)
    q = ctl.query(hashes)
    assert q.pages == n and q.errors == (), q
    got = ctl.prefetch(hashes, dst, extra_dst)
    assert got.errors == () and got.ok and got.pages == n, got
    for name in group:
        if name is PoolName.MAMBA:
            expect_same_pages(ref, group, name, [0, 1], [4, 5])
        elif name is PoolName.DRAFT:
            assert got.draft == [True] * n, got
            expect_same_pages(ref, group, name, src, dst)
        else:
            expect_same_pages(ref, group, name, src, dst)
    # a longer request: the stored prefix is restorable, the rest is not
    longer = [*hashes, *rand_hashes(3)]
    assert ctl.query(longer).pages == n


def embedded_options(master: Any, **kw: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "master_server_address": master.address,
        "local_hostname": "127.0.0.1",
        "global_segment_size": "256MB",
        "local_buffer_size": "16MB",
        "load_env": False,
    }
    opts.update(kw)
    return opts
