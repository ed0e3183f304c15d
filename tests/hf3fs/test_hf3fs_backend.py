"""The hf3fs backend in one process: round trips, persistence, LRU reuse, limits, sharing, MLA files."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from hf3fs_util import config, fill, page_bytes, pattern
from hicache_hf3fs_stub import _slotfile
from hicache_hf3fs_stub.hf3fs import DRAFT_REASON, Hf3fsBackend

from hicache_core import (
    BackendIOError,
    CacheController,
    HostPoolGroup,
    IndexerPool,
    IoOp,
    KeyFormatError,
    MambaPool,
    MHAKVPool,
    MLAKVPool,
    OptionsError,
    PoolError,
    PoolName,
    open_store,
    page_hashes,
)

N = 6  # pages per request in these tests


def mha(pages: int = 8, layout: str = "page_first") -> MHAKVPool:
    return MHAKVPool(pages, 4, 2, 2, 8, torch.bfloat16, layout=layout)


def hashes(seed: int, n: int = N) -> list[str]:
    return page_hashes(list(range(seed, seed + 4 * n)), 4)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_controller_round_trip_exact_bytes(tmp_path: Path, layout: str) -> None:
    cfg = config(tmp_path / "h", layout=layout)
    src, dst = mha(layout=layout), mha(layout=layout)
    fill(src, 1)
    hs = hashes(0)
    with CacheController(cfg, src) as ctl:
        assert ctl.io_path == "v1"
        assert ctl.backup(hs, range(N)).pages == N
        again = ctl.backup(hs, range(N))
        assert again.pages == N and again.skipped == N  # idempotent: existing pages are skipped
        assert ctl.query(hs).pages == N
        assert ctl.query([*hs[:3], *hashes(99, 2)]).pages == 3  # leading-prefix semantics
    with CacheController(cfg, dst) as ctl:  # reopen: the index survives
        got = ctl.prefetch(hs, [7, 6, 5, 4, 3, 2])
    assert got.pages == N and got.ok
    for i, j in zip(range(N), [7, 6, 5, 4, 3, 2]):
        assert page_bytes(src, i) == page_bytes(dst, j)


def test_mla_and_indexer_pools_round_trip(tmp_path: Path) -> None:
    cfg = config(tmp_path / "h", is_mla_model=True)
    kv, idx = MLAKVPool(8, 4, 3, 24), IndexerPool(8, 4, 3, 16)
    kv2, idx2 = MLAKVPool(8, 4, 3, 24), IndexerPool(8, 4, 3, 16)
    fill(kv, 2)
    fill(idx, 3)
    hs = hashes(5)
    with CacheController(cfg, HostPoolGroup(kv, {PoolName.INDEXER: idx})) as ctl:
        assert ctl.backup(hs, range(N)).ok
    with CacheController(cfg, HostPoolGroup(kv2, {PoolName.INDEXER: idx2})) as ctl:
        assert ctl.prefetch(hs, range(N)).pages == N
    for i in range(N):
        assert page_bytes(kv, i) == page_bytes(kv2, i)
        assert page_bytes(idx, i) == page_bytes(idx2, i)


def test_mamba_state_round_trip_and_slot_size_is_largest_component(tmp_path: Path) -> None:
    cfg = config(tmp_path / "h")
    kv, mamba = mha(), MambaPool(4, 2, (3, 40), [(5, 8), (7,)])
    kv2, mamba2 = mha(), MambaPool(4, 2, (3, 40), [(5, 8), (7,)])
    fill(kv, 4)
    fill(mamba, 5)
    hs = hashes(7)
    with CacheController(cfg, HostPoolGroup(kv, {PoolName.MAMBA: mamba})) as ctl:
        assert ctl.backup(hs, range(N), extra={PoolName.MAMBA: [2]}).ok
        backend = ctl.store.backend
        assert isinstance(backend, Hf3fsBackend)
        largest = max(*kv.component_nbytes, *mamba.component_nbytes)
        assert backend.bytes_per_page == largest == mamba.component_nbytes[0]
        assert backend._files["0"].capacity == largest
    with CacheController(cfg, HostPoolGroup(kv2, {PoolName.MAMBA: mamba2})) as ctl:
        got = ctl.prefetch(hs, range(N), extra={PoolName.MAMBA: [0]})
    assert got.pages == N
    assert page_bytes(mamba, 2) == page_bytes(mamba2, 0)


def _store_with(tmp_path: Path, **options: object):  # type: ignore[no-untyped-def]
    store = open_store(config(tmp_path / "h", options=dict(options)))
    store.register_pool(PoolName.KV, mha())
    return store


def _bufs(keys: list[str], nbytes: int = 256) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(pattern(k, nbytes)), dtype=torch.uint8) for k in keys]


def _read(store, keys: list[str], nbytes: int = 256) -> list[bytes | None]:  # type: ignore[no-untyped-def]
    out = [torch.zeros(nbytes, dtype=torch.uint8) for _ in keys]
    flags = store.batch_io_v1(IoOp.GET, keys, out)
    return [o.numpy().tobytes() if ok else None for o, ok in zip(out, flags)]


def test_lru_slot_reuse_when_full(tmp_path: Path) -> None:
    store = _store_with(tmp_path, num_slots=4)
    a, b, c, d, e, f, g = (f"k.{x}" for x in "abcdefg")

    def stored() -> set[str]:  # SlotFile.keys() does not refresh recency (exists/get/set do)
        return set(store.backend._files["0"].keys())

    assert store.batch_io_v1(IoOp.SET, [a, b, c, d], _bufs([a, b, c, d])) == [True] * 4
    assert _read(store, [a]) == [pattern(a, 256)]  # LRU order now b, c, d, a
    assert store.batch_io_v1(IoOp.SET, [e], _bufs([e])) == [True]
    assert stored() == {a, c, d, e}  # b was the least recently used
    assert store.batch_io_v1(IoOp.EXISTS, [c]) == [True]  # exists refreshes too: d, a, e, c
    store.batch_io_v1(IoOp.SET, [f], _bufs([f]))
    assert stored() == {a, c, e, f}
    assert _read(store, [a, c, e, f]) == [pattern(k, 256) for k in (a, c, e, f)]
    store.close()
    # after a restart the eviction order starts from write order: a (the oldest write) goes first
    store = _store_with(tmp_path, num_slots=4)
    store.batch_io_v1(IoOp.SET, [g], _bufs([g]))
    assert stored() == {c, e, f, g}
    assert _read(store, [c, e, f, g]) == [pattern(k, 256) for k in (c, e, f, g)]
    store.close()


def test_batch_larger_than_file_fails_its_tail_not_its_head(tmp_path: Path) -> None:
    store = _store_with(tmp_path, num_slots=3)
    keys = [f"k.{i}" for i in range(5)]
    assert store.batch_io_v1(IoOp.SET, keys, _bufs(keys)) == [True, True, True, False, False]
    assert _read(store, keys[:3]) == [pattern(k, 256) for k in keys[:3]]
    store.close()


def test_component_larger_than_slot_fails_with_false_and_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store_with(tmp_path, bytes_per_page=128)
    with caplog.at_level(logging.ERROR, logger="hicache.hf3fs"):
        flags = store.batch_io_v1(
            IoOp.SET, ["k.small", "k.big"], [*_bufs(["k.small"], 128), *_bufs(["k.big"])]
        )
    assert flags == [True, False]
    assert "exceed the 128-byte page slots" in caplog.text
    assert store.batch_io_v1(IoOp.EXISTS, ["k.small", "k.big"]) == [True, False]
    store.close()


def test_size_mismatch_on_get_is_a_miss_and_duplicates_in_a_batch(tmp_path: Path) -> None:
    store = _store_with(tmp_path)
    assert store.batch_io_v1(IoOp.SET, ["k.x", "k.x"], _bufs(["k.x", "k.x"])) == [True, True]
    assert _read(store, ["k.x"], nbytes=128) == [None]
    assert _read(store, ["k.x", "k.missing"]) == [pattern("k.x", 256), None]
    assert store.batch_io_v1(IoOp.EXISTS, []) == []
    store.close()


def test_bad_input_and_options_raise_typed_errors(tmp_path: Path) -> None:
    store = _store_with(tmp_path)
    with pytest.raises(KeyFormatError):
        store.batch_io_v1(IoOp.EXISTS, ["../etc/passwd"])
    with pytest.raises(PoolError, match="draft"):
        store.register_pool(PoolName.DRAFT, mha())
    store.close()
    with pytest.raises(OptionsError, match="file_sise"):
        open_store(config(tmp_path / "h", options={"file_sise": 1}))
    tiny = open_store(config(tmp_path / "t", options={"num_slots": None, "file_size": 65536}))
    tiny.register_pool(PoolName.KV, MHAKVPool(2, 64, 4, 4, 64))
    with pytest.raises(OptionsError, match="cannot hold one slot"):
        tiny.batch_io_v1(IoOp.SET, ["k.a"], _bufs(["k.a"]))
    tiny.close()
    bogus = tmp_path / "bogus"
    Path(f"{bogus}.0.bin").write_bytes(b"not a slot file" * 1000)
    store = open_store(config(bogus))
    store.register_pool(PoolName.KV, mha())
    with pytest.raises(BackendIOError, match="not a hicache hf3fs slot file"):
        store.batch_io_v1(IoOp.SET, ["k.a"], _bufs(["k.a"]))
    store.close()


def test_mla_ranks_share_rank0_file(tmp_path: Path) -> None:
    prefix = tmp_path / "h"
    src = MLAKVPool(8, 4, 2, 32)
    fill(src, 6)
    hs = hashes(11)
    rank = {"is_mla_model": True, "tp_size": 2}
    with CacheController(config(prefix, tp_rank=0, **rank), src) as ctl:
        assert ctl.backup(hs, range(N)).ok
    with CacheController(config(prefix, tp_rank=1, **rank), MLAKVPool(8, 4, 2, 32)) as ctl:
        res = ctl.backup(hashes(50), range(N))  # rank 1 never writes rank-replicated pages
        assert res.pages == N and res.skipped == N
        dst = ctl.pools.anchor
        assert ctl.prefetch(hs, range(N)).pages == N
        assert ctl.store.backend.path_for("0").exists()
    assert all(page_bytes(src, i) == page_bytes(dst, i) for i in range(N))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.0.bin", "h.0.bin.idx", "h.0.bin.lock"]
    # MHA ranks keep their own files
    with CacheController(config(prefix, tp_rank=1, tp_size=2), mha()) as ctl:
        assert ctl.backup(hs, range(N)).ok
    assert (tmp_path / "h.1.bin").exists()


def test_clear_removes_only_this_namespace(tmp_path: Path) -> None:
    prefix = tmp_path / "h"
    pools = {m: mha() for m in ("m1", "m2")}
    for m, pool in pools.items():
        fill(pool, 7)
        with CacheController(config(prefix, model_name=m), pool) as ctl:
            assert ctl.backup(hashes(3), range(N)).ok
    with CacheController(config(prefix, model_name="m1"), mha()) as ctl:
        assert ctl.clear() == 2 * N  # k and v of every page
        assert ctl.query(hashes(3)).pages == 0
    with CacheController(config(prefix, model_name="m2"), mha()) as ctl:
        assert ctl.query(hashes(3)).pages == N


def test_threads_share_one_store(tmp_path: Path) -> None:
    store = _store_with(tmp_path, num_slots=256)
    errors: list[str] = []

    def work(t: int) -> None:
        keys = [f"t{t}.k{i}" for i in range(20)]
        for _ in range(3):
            store.batch_io_v1(IoOp.SET, keys, _bufs(keys))
            got = _read(store, keys)
            if got != [pattern(k, 256) for k in keys]:
                errors.append(f"thread {t} read wrong bytes")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    store.close()


def test_two_stores_see_each_other_and_survive_compaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_slotfile, "COMPACT_MIN_BYTES", 1024)
    writer, reader = _store_with(tmp_path, num_slots=8), _store_with(tmp_path, num_slots=8)
    idx = Path(f"{tmp_path / 'h'}.0.bin.idx")
    inodes = set()
    for round_ in range(6):
        keys = [f"r{round_}.k{i}.{'x' * 100}" for i in range(6)]
        assert writer.batch_io_v1(IoOp.SET, keys, _bufs(keys)) == [True] * 6
        inodes.add(idx.stat().st_ino)
        assert _read(reader, keys) == [pattern(k, 256) for k in keys]  # tails the writer's log
    assert len(inodes) > 1, "the index log was never compacted"
    assert idx.stat().st_size < 6 * 6 * 130  # smaller than everything ever appended
    writer.close()
    reader.close()


def test_draft_capability_is_unsupported_with_reason(tmp_path: Path) -> None:
    store = _store_with(tmp_path)
    cap = store.draft_io()
    assert cap.mode.value == "unsupported" and cap.reason == DRAFT_REASON
    assert "sized for the target KV" in DRAFT_REASON
    caps = Hf3fsBackend.capabilities
    assert (caps.v1, caps.v2, caps.zero_copy, caps.persistent) == (True, False, False, True)
    assert PoolName.DRAFT not in caps.pools
    store.close()
