"""Round trips through the real installed ``file`` plugin: every pool kind, both layouts."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from file_helpers import config, fill, page_slice, pages, zero

from hicache_core import (
    BatchShapeError,
    CacheController,
    DraftIoMode,
    HostPoolGroup,
    IndexerPool,
    IoOp,
    MambaPool,
    MHAKVPool,
    MLAKVPool,
    PoolName,
    PoolTransfer,
    find_backends,
    open_store,
    page_hashes,
)
from hicache_core.plugin.registry import describe_backend


def test_entry_point_and_capabilities() -> None:
    info = find_backends()["file"]
    assert info.distribution == "hicache-file"
    assert info.value == "hicache_file:FileBackend"
    row = describe_backend("file")
    assert row["status"] == "ok"
    caps = row["capabilities"]
    assert caps["v1"] and caps["v2"] and not caps["zero_copy"]
    assert caps["persistent"] and caps["shared"]
    assert caps["pools"] == ["draft", "indexer", "kv", "mamba"]
    assert row["draft_io"] == "generic"


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mha_roundtrip(tmp_path: Path, layout: str, threads: int) -> None:
    cfg = config(tmp_path, layout=layout, options={"io_threads": threads, "parallel_min_bytes": 0})
    kv = MHAKVPool(24, 4, 3, 2, 8, layout=layout)
    fill(kv, 1)
    hashes = page_hashes(list(range(16 * 4)), 4)
    slots = [3, 7, 1, 0, 9, 12, 2, 5, 4, 6, 8, 10, 11, 13, 14, 15]
    want = pages(kv, slots)
    with CacheController(cfg, kv) as ctl:
        assert ctl.io_path == "v2"
        res = ctl.backup(hashes, slots)
        assert res.ok and res.pages == 16 and res.skipped == 0
        assert ctl.query(hashes).pages == 16
        zero(kv)
        dest = list(range(8, 24))
        res = ctl.prefetch(hashes, dest)
        assert res.ok and res.pages == 16
        assert pages(kv, dest) == want
        again = ctl.backup(hashes, slots)
        assert again.ok and ctl.store.backend.stats.skipped_writes == 32
        assert ctl.store.backend.stats.hits == 32


def test_mla_roundtrip_and_rank_replication(tmp_path: Path) -> None:
    hashes = page_hashes(list(range(40)), 8)
    kv0 = MLAKVPool(8, 8, 4, 32)
    fill(kv0, 2)
    want = pages(kv0, range(5))
    with CacheController(config(tmp_path, is_mla_model=True, tp_size=2, tp_rank=0), kv0) as ctl:
        assert ctl.backup(hashes, range(5)).ok
    kv1 = MLAKVPool(8, 8, 4, 32)
    with CacheController(config(tmp_path, is_mla_model=True, tp_size=2, tp_rank=1), kv1) as ctl:
        res = ctl.prefetch(hashes, range(5))
        assert res.pages == 5
    assert pages(kv1, range(5)) == want


def test_kv_plus_mamba(tmp_path: Path) -> None:
    hashes = page_hashes(list(range(48)), 8)  # 6 pages
    kv = MHAKVPool(8, 8, 2, 2, 8)
    mamba = MambaPool(4, 2, (3, 4), [(2, 5), (1, 7)])
    group = HostPoolGroup(kv, {PoolName.MAMBA: mamba})
    fill(kv, 3)
    fill(mamba, 4)
    want_kv = pages(kv, range(6))
    want_m = pages(mamba, [2, 3])
    with CacheController(config(tmp_path), group) as ctl:
        res = ctl.backup(hashes, range(6), extra={PoolName.MAMBA: [2, 3]})
        assert res.ok, res
        assert ctl.query(hashes).pages == 6
        zero(kv)
        zero(mamba)
        res = ctl.prefetch(hashes, range(6), extra={PoolName.MAMBA: [0, 1]})
        assert res.pages == 6, res
    assert pages(kv, range(6)) == want_kv
    assert pages(mamba, [0, 1]) == want_m


def test_kv_plus_indexer(tmp_path: Path) -> None:
    hashes = page_hashes(list(range(32)), 4)
    kv = MLAKVPool(8, 4, 2, 16)
    idx = IndexerPool(8, 4, 2, 12)
    group = HostPoolGroup(kv, {PoolName.INDEXER: idx})
    fill(kv, 5)
    fill(idx, 6)
    want = pages(kv, range(8)) + pages(idx, range(8))
    with CacheController(config(tmp_path, is_mla_model=True), group) as ctl:
        assert ctl.backup(hashes, range(8)).ok
        zero(kv)
        zero(idx)
        assert ctl.prefetch(hashes, range(8)).pages == 8
    assert pages(kv, range(8)) + pages(idx, range(8)) == want


def test_draft_generic_v1(tmp_path: Path) -> None:
    hashes = page_hashes(list(range(24)), 4)
    kv = MHAKVPool(6, 4, 2, 2, 8)
    draft = MHAKVPool(6, 4, 1, 2, 8)
    group = HostPoolGroup(kv, {PoolName.DRAFT: draft})
    fill(kv, 7)
    fill(draft, 8)
    want_d = pages(draft, range(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # generic draft must not be disabled
        ctl = CacheController(config(tmp_path), group)
    with ctl:
        assert ctl.draft_io.mode is DraftIoMode.GENERIC and ctl.draft_enabled
        res = ctl.backup(hashes, range(6))
        assert res.ok and res.draft == [True] * 6
        zero(draft)
        res = ctl.prefetch(hashes, range(6))
        assert res.pages == 6 and res.draft == [True] * 6
        names = {k.split(".")[1] for k in _keys(ctl.store.backend.root)}
        assert names == {"kv", "draft"}
    assert pages(draft, range(6)) == want_d


def _keys(root: Path) -> list[str]:
    from file_helpers import files_under

    return [f.rsplit("/", 1)[-1] for f in files_under(root)]


def test_v1_direct_strided_and_copy_buffers(tmp_path: Path) -> None:
    with open_store(config(tmp_path)) as store:
        base = torch.randint(0, 256, (4, 6, 10), dtype=torch.uint8)
        bufs = [
            base[0].reshape(-1),  # contiguous
            base[:, 1, :],  # rows contiguous, strided (layer_first-like)
            base[:, :, 3],  # fully strided -> scratch copy
            torch.empty(0, dtype=torch.uint8),  # empty payload
        ]
        keys = ["ns.t.contig", "ns.t.rows", "ns.t.strided", "ns.t.empty"]
        assert store.batch_io_v1(IoOp.SET, keys, bufs) == [True] * 4
        assert store.batch_io_v1(IoOp.EXISTS, [*keys, "ns.t.absent"]) == [True] * 4 + [False]
        outs = [torch.zeros_like(b) for b in bufs]
        outs[1] = torch.zeros(4, 6, 10, dtype=torch.uint8)[:, 2, :]
        outs[2] = torch.zeros(4, 6, 10, dtype=torch.uint8)[:, :, 7]
        assert store.batch_io_v1(IoOp.GET, keys, outs) == [True] * 4
        for b, o in zip(bufs, outs):
            assert torch.equal(b, o)
        # a buffer of another size is a miss (its content is then unspecified), not corruption
        small = torch.zeros(5, dtype=torch.uint8)
        assert store.batch_io_v1(IoOp.GET, ["ns.t.contig"], [small]) == [False]
        assert store.backend.stats.size_mismatches == 1
        assert store.backend.stats.integrity_errors == 0


def test_empty_batches_and_shape_errors(tmp_path: Path) -> None:
    with open_store(config(tmp_path)) as store:
        backend = store.backend
        assert backend.hicache_batch_io_v1(op=IoOp.GET, keys=[], buffers=[]) == []
        assert backend.hicache_batch_io_v2(op=IoOp.EXISTS, transfers=[]) == []
        with pytest.raises(BatchShapeError):
            backend.hicache_batch_io_v1(op=IoOp.SET, keys=["a.b"], buffers=[])
        with pytest.raises(BatchShapeError):
            backend.hicache_batch_io_v1(
                op=IoOp.SET, keys=["a.b"], buffers=[torch.zeros(4, dtype=torch.float32)]
            )
        kv = MHAKVPool(4, 1, 1, 1, 8)
        store.register_pool(PoolName.KV, kv)
        t = PoolTransfer(PoolName.KV, (), (), keys=())
        assert store.batch_io_v2(IoOp.GET, [t]) == [[]]
        with pytest.raises(BatchShapeError):  # keys not resolved
            backend.hicache_batch_io_v2(op=IoOp.GET, transfers=[PoolTransfer(PoolName.KV, (0,), ("ab",))])
        keys = store.page_keys(PoolName.KV, ["ab"])
        with pytest.raises(BatchShapeError):  # host index out of range
            store.batch_io_v2(IoOp.SET, [PoolTransfer(PoolName.KV, (9,), ("ab",), keys=tuple(keys))])


def test_v2_partial_results_per_page(tmp_path: Path) -> None:
    kv = MHAKVPool(8, 2, 2, 1, 8)
    fill(kv, 9)
    hashes = page_hashes(list(range(16)), 2)
    with CacheController(config(tmp_path), kv) as ctl:
        assert ctl.backup(hashes[:3], range(3)).ok
        # remove only the V component of page 1: page 1 must read False, pages 0 and 2 True
        keys = ctl.store.page_keys(PoolName.KV, hashes[:3])
        os.unlink(ctl.store.backend.path_of(keys[1][1]))
        t = PoolTransfer(PoolName.KV, (4, 5, 6), tuple(hashes[:3]), keys=tuple(keys))
        assert ctl.store.batch_io_v2(IoOp.EXISTS, [t]) == [[True, False, True]]
        assert ctl.store.batch_io_v2(IoOp.GET, [t]) == [[True, False, True]]
        want = [t.clone() for t in page_slice(kv, 1)]
        zero(kv)
        res = ctl.prefetch(hashes[:3], range(3))
        assert res.pages == 1
        assert all(torch.equal(a, b) for a, b in zip(want, page_slice(kv, 1)))


@pytest.mark.parametrize("publish", ["tmpfile", "rename"])
def test_set_skips_present_keys(tmp_path: Path, publish: str) -> None:
    opts = {"publish": publish}
    a, b = open_store(config(tmp_path, options=opts)), open_store(config(tmp_path, options=opts))
    first = torch.full((64,), 1, dtype=torch.uint8)
    second = torch.full((64,), 2, dtype=torch.uint8)
    with a, b:
        # a direct set of a present key is skipped (no write) and reported True
        assert a.batch_io_v1(IoOp.SET, ["s.k1"], [first]) == [True]
        assert b.batch_io_v1(IoOp.SET, ["s.k1"], [second]) == [True]
        assert b.backend.stats.skipped_writes == 1 and b.backend.stats.writes == 0
        # exists() said absent, then another process published it: still True, one copy
        assert a.batch_io_v1(IoOp.EXISTS, ["s.k2"]) == [False]
        assert b.batch_io_v1(IoOp.SET, ["s.k2"], [second]) == [True]
        assert a.batch_io_v1(IoOp.SET, ["s.k2"], [first]) == [True]
        out = torch.zeros(64, dtype=torch.uint8)
        assert a.batch_io_v1(IoOp.GET, ["s.k2"], [out]) == [True]
        if publish == "tmpfile":  # the first published copy wins; rename replaces it
            assert torch.equal(out, second) and a.backend.stats.skipped_writes == 1
        else:
            assert torch.equal(out, first)
    assert not any(".tmp-" in f for f in _keys(tmp_path))


@pytest.mark.parametrize("exact", [False, True])
def test_exact_skipped_option_chooses_the_existence_pass(tmp_path: Path, exact: bool) -> None:
    """By default ``set`` skips stored pages itself (``set_skips_existing``: no existence pass,
    ``skipped`` 0); ``exact_skipped`` narrows the capability so ``backup`` checks first and
    ``skipped`` counts the stored pages. Neither rewrites a stored page."""
    kv = MHAKVPool(8, 4, 3, 2, 8)
    fill(kv, 2)
    hashes = page_hashes(list(range(8 * 4)), 4)
    with CacheController(config(tmp_path, options={"exact_skipped": exact}), kv) as ctl:
        backend = ctl.store.backend
        assert backend.capabilities.set_skips_existing is not exact
        assert type(backend).capabilities.set_skips_existing  # the class is left alone
        assert ctl.backup(hashes[:5], range(5)).ok
        checks = backend.stats.exists_checks
        res = ctl.backup(hashes, range(8))
        assert res.ok and res.pages == 8
        assert res.skipped == (5 if exact else 0)
        assert backend.stats.exists_checks - checks == (16 if exact else 0)
        assert (backend.stats.writes, backend.stats.skipped_writes) == (16, 0 if exact else 10)
        zero(kv)
        assert ctl.prefetch(hashes, range(8)).pages == 8
