"""The worker side over vLLM-shaped CPU KV tensors (no engine): in-place loads and saves, load
errors, no save of a block whose load failed, asynchronous saves and loads reported when done,
failed asynchronous loads reported with their good pages, and aborted ones cancelled."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch
from hicache_vllm import PageFormat, parse_extra_config
from hicache_vllm._config import storage_config
from hicache_vllm._scheduler import PageOp
from hicache_vllm._worker import WorkerSide

from hicache_core import ConfigError, Layout, StorageConfig, Store, open_store, page_hashes

L, B, H, N, D = 2, 8, 2, 4, 16  # vLLM CPU layout: (blocks, kv_heads, block_size, 2 * head_dim)


def _kv() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    buf = torch.randn(L, B, H, N, 2 * D).to(torch.bfloat16)
    return buf, {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(L)}


def _worker(root: Path, *, async_save: bool = False, async_load: bool = False) -> WorkerSide:
    settings = parse_extra_config(
        {
            "backend": "file",
            "options": {"root": str(root)},
            "async_save": async_save,
            "async_load": async_load,
        }
    )
    assert settings.async_load is async_load
    page = PageFormat("tiny", None, "bfloat16", "cpu", "LBHNC", N, L, False, 1, 1)
    config = storage_config(settings, page, tp_rank=0, pp_rank=0)
    return WorkerSide(config, N, async_save=async_save, async_load=async_load)


HASHES = page_hashes(list(range(4 * N)), N)


def test_save_then_load_moves_the_engine_blocks_in_place(tmp_path: Path) -> None:
    buf, kv = _kv()
    w = _worker(tmp_path)
    w.register(kv)
    w.save([PageOp("r", HASHES, [1, 2, 3, 4])])
    want = buf[:, 1:5].clone()
    buf.zero_()
    w.load([PageOp("r", HASHES, [5, 6, 7, 0])])
    assert not w.load_errors()
    assert torch.equal(buf[:, [5, 6, 7, 0]], want)
    assert w.stats.save_pages == 4 and w.stats.load_pages == 4
    assert w.stats.load_bytes == 4 * L * H * N * 2 * D * 2
    w.close()


def test_a_steps_saves_are_one_transfer_each_page_once(tmp_path: Path) -> None:
    buf, kv = _kv()
    w = _worker(tmp_path)
    w.register(kv)
    assert w.path is not None
    puts: list[int] = []
    put = w.path.put
    w.path.put = lambda req, plans: puts.append(len(req.hashes)) or put(req, plans)  # type: ignore[method-assign]
    # two requests of one step share their first 3 pages (same hashes, other blocks)
    w.save([PageOp("r1", HASHES[:3], [1, 2, 3]), PageOp("r2", HASHES, [4, 5, 6, 7])])
    assert puts == [4] and w.stats.save_pages == 4
    rbuf, rkv = _kv()
    reader = _worker(tmp_path)
    reader.register(rkv)
    reader.load([PageOp("x", HASHES, [0, 1, 2, 3])])
    assert not reader.load_errors()
    assert torch.equal(rbuf[:, 0:3], buf[:, 1:4]) and torch.equal(rbuf[:, 3], buf[:, 7])
    reader.close()
    w.close()


def test_failed_loads_are_reported_and_never_saved_in_that_step(tmp_path: Path) -> None:
    buf, kv = _kv()
    w = _worker(tmp_path)
    w.register(kv)
    w.save([PageOp("r", HASHES[:2], [1, 2])])  # pages 2 and 3 are not stored
    w.load([PageOp("r", HASHES, [4, 5, 6, 7])])
    assert w.load_errors() == {6, 7} and w.load_errors() == set()
    assert w.short_loads() == {"r": 2} and w.short_loads() == {}  # its good leading pages
    assert w.stats.load_failed_pages == 2
    w.save([PageOp("r", HASHES, [4, 5, 6, 7])])  # same step: blocks 6, 7 hold no valid KV
    reader = _worker(tmp_path)
    reader.register(_kv()[1])
    reader.load([PageOp("x", HASHES, [0, 1, 2, 3])])
    assert reader.load_errors() == {2, 3}  # pages 2 and 3 were not written from blocks 6 and 7
    w.load([])  # the next step: blocks 6 and 7 were recomputed by vLLM
    w.save([PageOp("r", HASHES, [4, 5, 6, 7])])
    rbuf, rkv = _kv()
    reader2 = _worker(tmp_path)
    reader2.register(rkv)
    reader2.load([PageOp("x", HASHES, [0, 1, 2, 3])])
    assert not reader2.load_errors()
    assert torch.equal(rbuf[:, 2:4], buf[:, 6:8])  # the recomputed blocks' bytes
    reader2.close()
    w.close()
    reader.close()


def test_async_saves_are_reported_when_done(tmp_path: Path) -> None:
    _, kv = _kv()
    w = _worker(tmp_path, async_save=True)
    w.register(kv)
    w.save([PageOp("r", HASHES, [0, 1, 2, 3])])
    done: set[str] = set()
    deadline = time.monotonic() + 30
    while "r" not in done and time.monotonic() < deadline:
        done |= w.finished_saves({"r"} if not done else set())
        time.sleep(0.01)
    assert done == {"r"} and w.stats.save_pages == 4
    assert w.finished_saves({"other"}) == set()  # never sent a save: vLLM freed it already
    missing = page_hashes([9] * N, N)
    w.load([PageOp("f", missing, [7])])  # fails: block 7 holds no valid KV in this step
    w.save([PageOp("f", missing, [7])])  # nothing to write, but vLLM waits for the report
    assert w.finished_saves({"f"}) == {"f"}
    w.drain()
    w.close()


def test_unviewable_kv_cache_is_refused(tmp_path: Path) -> None:
    w = _worker(tmp_path)
    with pytest.raises(Exception, match="allocation"):
        w.register({"a": torch.zeros(B, H, N, 2 * D), "b": torch.zeros(B, H, N, 2 * D)})
    w.load([PageOp("r", HASHES, [0, 1, 2, 3])])  # not registered: every page fails, nothing raises
    assert w.load_errors() == {0, 1, 2, 3}
    w.close()


def _until_loaded(w: WorkerSide, req_ids: set[str], finished: set[str] | None = None) -> set[str]:
    done: set[str] = set()
    deadline = time.monotonic() + 30
    while not req_ids <= done and time.monotonic() < deadline:
        done |= w.finished_loads(finished or set())
        time.sleep(0.01)
    return done


def test_async_loads_report_done_and_failed_blocks(tmp_path: Path) -> None:
    buf, kv = _kv()
    w = _worker(tmp_path)
    w.register(kv)
    w.save([PageOp("w", HASHES, [1, 2, 3, 4])])
    want = buf[:, 1:5].clone()
    (corrupt,) = [p for p in tmp_path.rglob(f"*{HASHES[2]}*") if p.is_file()]
    data = bytearray(corrupt.read_bytes())
    data[-8:] = bytes(b ^ 0x5A for b in data[-8:])
    corrupt.write_bytes(bytes(data))
    w.close()
    rbuf, rkv = _kv()
    r = _worker(tmp_path, async_load=True)
    r.register(rkv)
    r.start_async_loads([PageOp("ok", HASHES[:2], [5, 6]), PageOp("bad", HASHES, [0, 1, 2, 3])])
    r.start_async_loads([PageOp("noblocks", [], [])])  # nothing to write: failed as a whole
    assert _until_loaded(r, {"ok", "bad", "noblocks"}) == {"ok", "bad", "noblocks"}
    # the corrupt page 2 fails the request: vLLM recomputes it, the scheduler then claims pages 0-1
    assert r.failed_requests() == {"bad": 2, "noblocks": 0} and r.failed_requests() == {}
    assert not r.load_errors()
    assert torch.equal(rbuf[:, [5, 6]], want[:, :2]) and torch.equal(rbuf[:, [0, 1]], want[:, :2])
    assert r.stats.load_failed_pages == 2 and r.finished_loads(set()) == set()
    r.close()


def test_async_load_of_an_aborted_request_is_cancelled_or_awaited(tmp_path: Path) -> None:
    _, kv = _kv()
    r = _worker(tmp_path, async_load=True)
    r.register(kv)
    gate = threading.Event()
    r.start_async_loads([PageOp("first", HASHES, [0, 1, 2, 3])])
    assert r._loader is not None
    r._loader.submit(gate.wait, 30)  # holds the load thread: the next load cannot start yet
    r.start_async_loads([PageOp("aborted", HASHES, [4, 5, 6, 7])])
    # vLLM finished (aborted) the request: its load never starts, it is reported at once
    done = r.finished_loads({"aborted"})
    assert "aborted" in done
    gate.set()
    done |= _until_loaded(r, {"first"} - done)
    assert done == {"first", "aborted"}
    # an empty store: every page of "first" failed; "aborted" never ran (no blocks 4-7 touched)
    assert r.failed_requests() == {"first": 0} and r.stats.load_failed_pages == 4
    r.close()


def test_config_layout_is_the_pools_and_names_the_keys(tmp_path: Path) -> None:
    """vLLM's CPU LBHNC cache is a layer_first pool: the worker's config (and so its key
    namespace) says layer_first, and the handshake reports it to the scheduler."""
    _, kv = _kv()
    w = _worker(tmp_path)
    w.register(kv)
    assert w.pool is not None and w.store is not None
    assert w.pool.layout is Layout.LAYER_FIRST and w.layout is Layout.LAYER_FIRST
    assert w.config.layout is Layout.LAYER_FIRST and w.store.config.layout is Layout.LAYER_FIRST
    assert "-layer_first-" in w.store.keys.scheme.namespace
    w.save([PageOp("r", HASHES[:1], [1])])
    (page,) = [p for p in tmp_path.rglob(f"*{HASHES[0]}*") if p.is_file()]
    assert "-layer_first-" in str(page.relative_to(tmp_path))
    w.close()
    # blocks outermost across layers (one contiguous run per page): a page_first pool
    blocks = torch.randn(B, L, H, N, 2 * D).to(torch.bfloat16)
    w = _worker(tmp_path)
    w.register({f"model.layers.{i}.self_attn.attn": blocks[:, i] for i in range(L)})
    assert w.layout is Layout.PAGE_FIRST and w.config.layout is Layout.PAGE_FIRST
    assert w.store is not None and "-page_first-" in w.store.keys.scheme.namespace
    w.close()


def test_io_timeout_on_a_v2_only_backend_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As CacheController refuses it: an abandoned v2 call could write vLLM's blocks later."""
    import hicache_vllm._worker as worker_mod

    def v2_only(config: StorageConfig) -> Store:
        store = open_store(config)
        store.capabilities = dataclasses.replace(store.capabilities, v1=False, v2=True)
        return store

    monkeypatch.setattr(worker_mod, "open_store", v2_only)
    settings = parse_extra_config({"backend": "file", "options": {"root": str(tmp_path)}, "io_timeout_s": 5})
    page = PageFormat("tiny", None, "bfloat16", "cpu", "LBHNC", N, L, False, 1, 1)
    w = WorkerSide(storage_config(settings, page, tp_rank=0, pp_rank=0), N, async_save=False)
    with pytest.raises(ConfigError, match=r"implements only v2.*io_timeout_s"):
        w.register(_kv()[1])
    assert w.store is None and w.path is None
    w.close()


def test_mla_pages_are_one_shared_key_that_rank_0_writes(tmp_path: Path) -> None:
    """MLA's latent KV is the same on every tensor-parallel rank: one key per page, written by
    rank 0, read by every rank (design: MLA KV is rank-replicated)."""
    settings = parse_extra_config({"backend": "file", "options": {"root": str(tmp_path)}})
    page = PageFormat("tiny-mla", None, "bfloat16", "cpu", "LBHNC", N, L, True, 2, 1)
    bufs, workers = [], []
    for rank in (0, 1):
        buf = torch.randn(L, B, N, D).to(torch.bfloat16)  # MLA on CPU: (blocks, block_size, latent)
        w = WorkerSide(storage_config(settings, page, tp_rank=rank, pp_rank=0), N, async_save=False)
        w.register({f"model.layers.{i}.self_attn.attn": buf[i] for i in range(L)})
        assert w.pool is not None and w.pool.rank_replicated
        bufs.append(buf)
        workers.append(w)
    workers[1].save([PageOp("r", HASHES, [1, 2, 3, 4])])  # not rank 1's to write
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and HASHES[0] in p.name]
    workers[0].save([PageOp("r", HASHES, [1, 2, 3, 4])])
    files = [p for p in tmp_path.rglob("*") if p.is_file() and any(h in p.name for h in HASHES)]
    assert len(files) == 4 and all(".kv.kv.all." in p.name for p in files)
    workers[1].load([PageOp("r", HASHES, [5, 6, 7, 0])])
    assert not workers[1].load_errors()
    assert torch.equal(bufs[1][:, [5, 6, 7, 0]], bufs[0][:, 1:5])
    for w in workers:
        w.close()
