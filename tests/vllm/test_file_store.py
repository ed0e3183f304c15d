"""vLLM with the ``file`` backend: a second process reuses the first one's pages; corrupt and
missing pages are recomputed; two models on one store never share pages."""

from __future__ import annotations

import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tiny_model import BLOCK, PROMPTS
from vllm_helpers import run_engine

from hicache_core import page_hashes

# the engines start in fresh processes: minutes on a loaded 2-core machine
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def runs(
    tiny_models: list[Path],
    tmp_path_factory: pytest.TempPathFactory,
    baseline: Future[dict[str, Any]],
    engines: ThreadPoolExecutor,
) -> dict[str, Any]:
    """A then B on one store; B2 on a damaged copy; B2 with asynchronous loads on a second
    damaged copy; model 1 on the store; model 0 on two tensor-parallel ranks on the store; the
    baseline. Independent engines run two at a time: A with the baseline, then the others."""
    model0, model1 = (str(m) for m in tiny_models)
    store = tmp_path_factory.mktemp("store")
    file_cfg = {"backend": "file", "options": {"root": str(store)}}
    out: dict[str, Any] = {}
    # A saves on the background thread (async_save): vLLM holds each finished request's blocks
    # until get_finished reports its saves done; B and the rest save synchronously.
    out["a"] = run_engine(
        {"model": model0, "prompts": PROMPTS, "connector": {**file_cfg, "async_save": True}}
    )
    # B2's store: prompt 0 with its 4th page corrupted on disk, prompt 1 with its 3rd page deleted
    damaged = tmp_path_factory.mktemp("damaged") / "store"
    shutil.copytree(store, damaged)
    ids = [r["prompt_token_ids"] for r in out["a"]["results"]]
    corrupt = _page_file(damaged, page_hashes(ids[0], BLOCK)[3])
    data = bytearray(corrupt.read_bytes())
    for i in range(len(data) - 64, len(data)):
        data[i] ^= 0x5A
    corrupt.write_bytes(bytes(data))
    _page_file(damaged, page_hashes(ids[1], BLOCK)[2]).unlink()
    damaged_async = tmp_path_factory.mktemp("damaged_async") / "store"
    shutil.copytree(damaged, damaged_async)
    damaged_cfg = {**file_cfg, "options": {"root": str(damaged)}}
    async_cfg = {**file_cfg, "options": {"root": str(damaged_async)}, "async_load": True}
    # model 0 on two tensor-parallel ranks (one worker process each), vLLM's prefix cache off, on
    # A's store: A's pages (tp_size 1) are not its pages; the second serving loads its own
    tp2 = engines.submit(
        run_engine,
        {
            "model": model0,
            "prompts": PROMPTS[:1] * 2,
            "connector": file_cfg,
            "tensor_parallel_size": 2,
            "enable_prefix_caching": False,
        },
        420,
    )
    b = engines.submit(run_engine, {"model": model0, "prompts": PROMPTS, "connector": file_cfg})
    b2 = engines.submit(run_engine, {"model": model0, "prompts": PROMPTS, "connector": damaged_cfg})
    other = engines.submit(run_engine, {"model": model1, "prompts": PROMPTS, "connector": file_cfg})
    b2_async = engines.submit(run_engine, {"model": model0, "prompts": PROMPTS, "connector": async_cfg})
    out["b2"] = b2.result()
    out["corrupted"] = (corrupt.name, bytes(data))
    out["damaged"] = damaged
    out["b2_async"] = b2_async.result()
    out["b"], out["other_model"], out["baseline"] = b.result(), other.result(), baseline.result()
    out["tp2"] = tp2.result()
    out["store"] = store
    return out


def _page_file(root: Path, page_hash: str) -> Path:
    found = [p for p in root.rglob(f"*{page_hash}*") if p.is_file()]
    assert len(found) == 1, f"expected one file for page {page_hash[:12]}, found {found}"
    return found[0]


def _tokens(run: dict[str, Any]) -> list[list[int]]:
    return [r["token_ids"] for r in run["results"]]


def test_second_process_loads_the_first_ones_pages(runs: dict[str, Any]) -> None:
    a, b, base = runs["a"], runs["b"], runs["baseline"]
    assert all(len(r["prompt_token_ids"]) >= 6 * BLOCK for r in a["results"])
    assert [r["num_cached_tokens"] for r in a["results"]] == [0, 0]
    for r in b["results"]:
        assert r["num_cached_tokens"] >= 5 * BLOCK
        assert r["num_cached_tokens"] == 6 * BLOCK  # every full block but the last token's
    assert _tokens(b) == _tokens(a) == _tokens(base)
    assert [r["text"] for r in b["results"]] == [r["text"] for r in base["results"]]
    moved = b["stats"]["transfers"]
    assert moved["load_pages"] == 12 and moved["load_failed_pages"] == 0
    metrics = b["stats"]["metrics"]["pools"]["kv"]
    assert metrics["pages_read"] == 12 and metrics["bytes_read"] == moved["load_bytes"] > 0
    assert a["stats"]["transfers"]["save_pages"] == 12
    # the keys name the layout of the workers' pool over vLLM's CPU cache, and B's scheduler
    # (told it by the workers' handshake) asked about those keys: it found and loaded them
    store: Path = runs["store"]
    pages = [p.relative_to(store) for p in store.rglob("*.kv.kv.tp*") if p.is_file()]
    assert pages and all("-layer_first-" in str(p) for p in pages)


def test_corrupt_and_missing_pages_are_recomputed(runs: dict[str, Any]) -> None:
    b2, base = runs["b2"], runs["baseline"]
    assert _tokens(b2) == _tokens(base), "a damaged store changed the output"
    corrupt_run, missing_run = b2["results"]
    assert missing_run["num_cached_tokens"] == 2 * BLOCK  # pages 0-1 only: page 2 is gone
    moved = b2["stats"]["transfers"]
    assert moved["load_failed_pages"] == 3  # the corrupt page 3 and pages 4-5 after it: recomputed
    assert b2["stats"]["metrics"]["integrity_errors"] == 1
    assert "Traceback" not in b2["stderr"]
    # the recomputed pages were written back: the deleted page is there again, the corrupt one
    # (removed when its checksum failed) replaced
    ids = [r["prompt_token_ids"] for r in b2["results"]]
    name, corrupted = runs["corrupted"]
    rewritten = _page_file(runs["damaged"], page_hashes(ids[0], BLOCK)[3])
    assert rewritten.name == name and rewritten.read_bytes() != corrupted
    assert _page_file(runs["damaged"], page_hashes(ids[1], BLOCK)[2]).stat().st_size == len(corrupted)
    # vLLM records the claim (6 pages) when it admits the request; the connector corrects it to
    # the 3 pages loaded before the corrupt one
    assert corrupt_run["num_cached_tokens"] == 3 * BLOCK


def test_two_models_never_share_pages(runs: dict[str, Any]) -> None:
    other = runs["other_model"]
    assert [r["num_cached_tokens"] for r in other["results"]] == [0, 0]
    assert other["stats"]["transfers"]["load_pages"] == 0
    assert _tokens(other) != _tokens(runs["baseline"])  # the weights really differ


def test_asynchronous_loads_recompute_corrupt_and_missing_pages(runs: dict[str, Any]) -> None:
    """``async_load``: vLLM waits for the load thread (``finished_recving``). The load that meets
    the corrupt page fails the request (``failed_recving``); vLLM asks again, the scheduler
    claims only the 3 good pages, so ``num_cached_tokens`` shows the recompute."""
    b2a, base = runs["b2_async"], runs["baseline"]
    assert _tokens(b2a) == _tokens(base), "a damaged store changed the output"
    assert [r["num_cached_tokens"] for r in b2a["results"]] == [3 * BLOCK, 2 * BLOCK]
    moved = b2a["stats"]["transfers"]
    # prompt 0: pages 0-2 loaded, 3 failed (4-5 not used), then pages 0-2 again; prompt 1: 0-1
    assert moved["load_pages"] == 3 + 3 + 2 and moved["load_failed_pages"] == 3
    assert b2a["stats"]["metrics"]["integrity_errors"] == 1
    assert "Traceback" not in b2a["stderr"]


def test_tensor_parallel_ranks_share_pages_of_their_tp_size_only(runs: dict[str, Any]) -> None:
    """Keys carry the tensor-parallel rank and size: a TP=2 engine finds none of A's TP=1 pages
    of the same model, stores its own (one per rank) and loads them when the prompt comes again
    (vLLM's prefix cache is off: every cached token is from the store)."""
    results = runs["tp2"]["results"]
    assert [r["num_cached_tokens"] for r in results] == [0, 6 * BLOCK]
    assert results[1]["token_ids"] == results[0]["token_ids"]
    assert "Traceback" not in runs["tp2"]["stderr"]
