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
    """A then B on one store; B2 then B3 on a damaged copy; model 1 on the store; the baseline.

    Independent engines run side by side: A with the baseline, then B, B2 and model 1."""
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
    damaged_cfg = {**file_cfg, "options": {"root": str(damaged)}}
    b = engines.submit(run_engine, {"model": model0, "prompts": PROMPTS, "connector": file_cfg})
    b2 = engines.submit(run_engine, {"model": model0, "prompts": PROMPTS, "connector": damaged_cfg})
    other = engines.submit(run_engine, {"model": model1, "prompts": PROMPTS, "connector": file_cfg})
    out["b2"] = b2.result()
    out["b3"] = run_engine({"model": model0, "prompts": PROMPTS, "connector": damaged_cfg})
    out["b"], out["other_model"], out["baseline"] = b.result(), other.result(), baseline.result()
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


def test_corrupt_and_missing_pages_are_recomputed(runs: dict[str, Any]) -> None:
    b2, base = runs["b2"], runs["baseline"]
    assert _tokens(b2) == _tokens(base), "a damaged store changed the output"
    corrupt_run, missing_run = b2["results"]
    assert missing_run["num_cached_tokens"] == 2 * BLOCK  # pages 0-1 only: page 2 is gone
    moved = b2["stats"]["transfers"]
    assert moved["load_failed_pages"] == 3  # the corrupt page 3 and pages 4-5 after it: recomputed
    assert b2["stats"]["metrics"]["integrity_errors"] == 1
    assert "Traceback" not in b2["stderr"]
    # the recomputed pages were written back: the next process loads everything again
    assert [r["num_cached_tokens"] for r in runs["b3"]["results"]] == [6 * BLOCK, 6 * BLOCK]
    assert _tokens(runs["b3"]) == _tokens(base)
    # vLLM counts a claimed block as cached when it schedules the request, before the load runs,
    # so the corrupt-page run still reports the claim; the recompute shows in the load failures.
    assert corrupt_run["num_cached_tokens"] == 6 * BLOCK


def test_two_models_never_share_pages(runs: dict[str, Any]) -> None:
    other = runs["other_model"]
    assert [r["num_cached_tokens"] for r in other["results"]] == [0, 0]
    assert other["stats"]["transfers"]["load_pages"] == 0
    assert _tokens(other) != _tokens(runs["baseline"])  # the weights really differ
