"""The connector's pure parts, without an engine: extra-config checks and scheduler bookkeeping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hicache_vllm import PageFormat, parse_extra_config
from hicache_vllm._config import ENGINE_FIELDS, storage_config
from hicache_vllm._scheduler import SchedulerSide

from hicache_core import ComponentSpec, ConfigError, HostPool, PoolName, open_store, page_hashes
from hicache_core.transfer import Plan, Request, TransferPath

BS = 4
PAGE = PageFormat("m", None, "bfloat16", "cpu", "LBHNC", BS, 2, False, 1, 1)


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({}, "must name a hicache backend"),
        ([], "must be a JSON object"),
        ({"backend": "file", "optoins": {}}, "did you mean 'options'"),
        ({"backend": "file", "options": []}, "'options' must be a JSON object"),
        ({"backend": "file", "model_name": "x"}, "model_name"),
        ({"backend": "file", "tp_rank": 1}, "tp_rank"),
        ({"backend": "file", "batch_pages": 0}, "batch_pages"),
        ({"backend": "", "options": {}}, "'backend'"),
        ({"backend": "file", "async_save": "yes"}, "async_save"),
        ({"backend": "file", "async_load": 1}, "async_load"),
        ({"config": 3}, "'config'"),
    ],
)
def test_bad_extra_config_names_the_key(extra: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_extra_config(extra)  # type: ignore[arg-type]
    assert issubclass(ConfigError, ValueError)


def test_config_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "hicache.toml"
    path.write_text('backend = "file"\nbatch_pages = 16\n[options]\nroot = "/a"\nfsync = false\n')
    settings = parse_extra_config({"config": str(path), "options": {"root": "/b"}, "async_save": True})
    two_ranks = PageFormat("m", "rev1", "bfloat16", "cpu", "LBHNC", BS, 2, False, 2, 1)
    cfg = storage_config(settings, two_ranks, tp_rank=1, pp_rank=0)
    assert cfg.backend == "file" and cfg.options == {"root": "/b", "fsync": False}
    assert cfg.controller.batch_pages == 16 and settings.async_save
    assert "metrics" in cfg.extensions  # on by default
    assert cfg.model_name == "m@vllm:cpu:LBHNC:bs4:L2" and cfg.kv_dtype == "bfloat16" and cfg.tp_rank == 1
    assert cfg.model_revision == "rev1" and cfg.tp_size == 2
    path.write_text('backend = "file"\nmodel_name = "other"\n')
    with pytest.raises(ConfigError, match="model_name"):
        parse_extra_config({"config": str(path)})


def _scheduler(root: Path) -> tuple[SchedulerSide, HostPool, TransferPath]:
    cfg = storage_config(
        parse_extra_config({"backend": "file", "options": {"root": str(root)}}), PAGE, tp_rank=0, pp_rank=0
    )
    store = open_store(cfg)
    probe = HostPool([ComponentSpec("kv", 1, (1,), torch.uint8)], 1)
    store.register_pool(PoolName.KV, probe)
    path = TransferPath(store, "v1", batch_pages=8)
    return SchedulerSide(store, probe, path, BS), probe, path


def _store_pages(side: SchedulerSide, hashes: list[str]) -> None:
    """Write ``hashes`` as pages of a second, real pool with the same component names."""
    pool = HostPool([ComponentSpec("kv", 2, (8,), torch.uint8)], len(hashes))
    store = open_store(side.store.config)
    store.register_pool(PoolName.KV, pool)
    path = TransferPath(store, "v1", batch_pages=8)
    flags, _ = path.put(
        Request(hashes), [Plan(PoolName.KV, pool, list(range(len(hashes))), list(range(len(hashes))))]
    )
    assert all(flags[PoolName.KV])
    store.close()


def test_lookup_counts_leading_pages_and_never_the_last_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    side, _, _ = _scheduler(tmp_path)
    prompt = list(range(100, 100 + 4 * BS))  # exactly 4 pages
    hashes = page_hashes(prompt, BS)
    assert side.matched_tokens("r", prompt, 0) == 0
    _store_pages(side, hashes)
    assert side.matched_tokens("r", prompt, 0) == 3 * BS  # the 4th page holds the last token
    assert side.matched_tokens("r", [*prompt, 7], 0) == 4 * BS
    assert side.matched_tokens("r", [*prompt, 7], 2 * BS) == 2 * BS  # beyond vLLM's own hit
    assert side.stats.queries == 4 and side.stats.errors == 0

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("store unreachable")

    monkeypatch.setattr(side.path, "exists", broken)
    assert side.matched_tokens("r", prompt, 0) == 0  # a failed lookup answers "recompute"
    assert side.stats.errors == 1
    side.close()


def test_loads_and_saves_per_step(tmp_path: Path) -> None:
    side, _, _ = _scheduler(tmp_path)
    prompt = list(range(10 * BS + 2))
    hashes = page_hashes(prompt, BS)
    blocks = list(range(50, 61))
    side.matched_tokens("r", prompt, 2 * BS)  # vLLM had 2 pages
    side.after_alloc("r", prompt, 3 * BS)  # 3 pages granted
    ops = side.build([("r", 5 * BS, 4 * BS)], lambda _: blocks)  # chunk: tokens 20..36
    assert [(op.hashes, op.block_ids) for op in ops.loads] == [(hashes[2:5], blocks[2:5])]
    assert [(op.hashes, op.block_ids) for op in ops.saves] == [(hashes[2:9], blocks[2:9])]
    ops = side.build([("r", 9 * BS, BS + 2)], lambda _: blocks)  # the rest of the prompt
    assert not ops.loads and [op.hashes for op in ops.saves] == [hashes[9:10]]
    ops = side.build([("r", 10 * BS + 2, 1)], lambda _: blocks)  # decode: nothing
    assert not ops.loads and not ops.saves
    ops = side.build([("r", 3 * BS, 7 * BS + 2)], lambda _: blocks)  # rewound after a failed load
    assert [op.hashes for op in ops.saves] == [hashes[3:10]]
    side.finished("r")
    assert not side.build([("r", 0, 4)], lambda _: blocks).saves
    side.close()


def test_async_load_is_sent_with_the_next_step_unscheduled(tmp_path: Path) -> None:
    side, _, _ = _scheduler(tmp_path)
    prompt = list(range(10 * BS + 2))
    hashes = page_hashes(prompt, BS)
    blocks = list(range(50, 61))
    side.matched_tokens("r", prompt, 2 * BS)
    side.after_alloc("r", prompt, 3 * BS, async_blocks=blocks[:5])  # vLLM waits for the load
    side.matched_tokens("s", prompt, 0)
    side.after_alloc("s", prompt, 2 * BS, async_blocks=blocks[:1])  # too few blocks: sent empty
    ops = side.build([], lambda _: blocks)  # neither request is scheduled in this step
    assert [(op.req_id, op.hashes, op.block_ids) for op in ops.async_loads] == [
        ("r", hashes[2:5], blocks[2:5]),
        ("s", [], []),
    ]
    assert not ops.loads and not ops.saves and not side.build([], lambda _: blocks).async_loads
    side.load_failed("s", 0)  # s's async load failed at its first page: vLLM asks again
    _store_pages(side, hashes[:4])
    assert side.matched_tokens("s", prompt, 0) == 0  # never the failed page (no endless retry)
    side.load_failed("r", 2)  # r's third granted page failed: pages 2-3 claimed again, not 4
    assert side.matched_tokens("r", prompt, 0) == 4 * BS
    side.after_alloc("r", prompt, 0)  # scheduled once loaded: the loaded pages are not loaded again
    ops = side.build([("r", 5 * BS, 5 * BS + 2)], lambda _: blocks)
    # every prompt page from the last lookup's start is offered for saving (stored ones skipped)
    assert not ops.loads and not ops.async_loads and [op.hashes for op in ops.saves] == [hashes[:10]]
    side.close()


@pytest.fixture
def no_hicache_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("HICACHE_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_environment_layer_between_file_and_extra_config(
    tmp_path: Path, no_hicache_env: pytest.MonkeyPatch
) -> None:
    """file < HICACHE_* < extra config, options and controller settings merged one by one, as
    hicache_core.load_config merges them; HICACHE_CONFIG names the file when the extra config
    does not."""
    env = no_hicache_env
    path = tmp_path / "hicache.toml"
    path.write_text('backend = "file"\nbatch_pages = 8\nio_threads = 3\n[options]\nroot = "/f"\n')
    env.setenv("HICACHE_CONFIG", str(path))
    env.setenv("HICACHE_BATCH_PAGES", "16")
    env.setenv("HICACHE_OPTIONS", '{"root": "/e", "fsync": true}')
    cfg = storage_config(parse_extra_config({}), PAGE, tp_rank=0, pp_rank=0)
    assert cfg.options == {"root": "/e", "fsync": True}
    assert cfg.controller.batch_pages == 16 and cfg.controller.io_threads == 3
    extra = {"options": {"root": "/x"}, "batch_pages": 32}
    cfg = storage_config(parse_extra_config(extra), PAGE, tp_rank=0, pp_rank=0)
    assert cfg.options == {"root": "/x", "fsync": True} and cfg.controller.batch_pages == 32
    env.delenv("HICACHE_CONFIG")
    env.setenv("HICACHE_BACKEND", "file")  # names the backend: no file, no extra "backend"
    env.setenv("HICACHE_ENABLE_STORAGE_METRICS", "false")
    cfg = storage_config(parse_extra_config({}), PAGE, tp_rank=0, pp_rank=0)
    assert cfg.options == {"root": "/e", "fsync": True} and cfg.controller.io_threads == 2
    assert "metrics" not in cfg.extensions  # the operator's "off" wins over the connector's default


def test_environment_typos_and_engine_fields_are_refused(no_hicache_env: pytest.MonkeyPatch) -> None:
    env = no_hicache_env
    env.setenv("HICACHE_BACTH_PAGES", "16")
    with pytest.raises(ConfigError, match="did you mean HICACHE_BATCH_PAGES"):
        parse_extra_config({"backend": "file"})
    env.delenv("HICACHE_BACTH_PAGES")
    env.setenv("HICACHE_MODEL_NAME", "mine")  # the connector's: the same answer as in the extra config
    with pytest.raises(ConfigError, match=r"HICACHE_MODEL_NAME.*from vLLM's own config.*unset"):
        parse_extra_config({"backend": "file"})


@pytest.mark.parametrize(
    "key, value", [("disaggregation_mode", "decode"), ("mamba_scheduler_strategy", "extra_buffer")]
)
def test_sglang_fields_are_refused_as_what_they_are(key: str, value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'.*SGLang settings") as err:
        parse_extra_config({"backend": "file", key: value})
    assert "from vLLM's own config" not in str(err.value)
    path = tmp_path / "hicache.toml"
    path.write_text(f'backend = "file"\n{key} = "{value}"\n')
    with pytest.raises(ConfigError, match=f"'{key}'.*SGLang settings.*remove them from the file"):
        parse_extra_config({"config": str(path)})


def test_readme_lists_every_refused_key() -> None:
    readme = (Path(__file__).parents[2] / "integrations" / "vllm" / "README.md").read_text()
    for name in sorted(ENGINE_FIELDS):
        group = name.rsplit("_", 1)[0] + "_*"  # tp_rank, tp_size: `tp_*`
        assert f"`{name}`" in readme or f"`{group}`" in readme, name
