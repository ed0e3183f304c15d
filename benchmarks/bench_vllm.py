"""vLLM with ``HiCacheConnector``: time to first token and the connector's page throughput.

Runs only where ``.venv-vllm/`` exists (``integrations/vllm/setup-dev.sh``); ``run()`` starts
each measurement in a fresh ``.venv-vllm`` process running this file with ``--child``.

* ``vllm_ttft_hicache_vs_recompute``: a small random Llama (4 layers, hidden 512, built
  locally) with vLLM's own prefix cache off serves a repeated 1024-token prompt; the median
  time to first token (a 1-token generation) when the ``file`` backend provides the prompt's
  pages, divided by the median when vLLM recomputes them (an engine without the connector, in
  its own process). Lower is better; target <= 0.5.
* ``vllm_load_vs_controller``: GB/s of the connector's worker loading N block-sized pages from
  the ``file`` backend into vLLM's KV cache, divided by GB/s of hicache's own ``CacheController``
  prefetching N pages into the same vLLM blocks (the same memory, viewed by the same
  ``ExternalPool``), in the same process and run (warm page cache for both): per round the
  contenders back to back, the order rotating, and the median over rounds of the paired ratio.
  Target >= 0.9. It measures what the connector adds to the controller's own path. Reported
  with it: ``vs_page_first_pool``, the connector against a controller reading the same pages
  into a contiguous host pool of its own, in the connector's layout (the cost of viewing vLLM's
  KV cache in place).
  ``vllm_save_vs_controller`` is the same for writing fresh pages (backup), the connector
  handed them as vLLM hands one engine step of ``STEP_REQUESTS`` requests (its worker writes a
  step's pages in one transfer), the controller in one ``backup`` call.
* ``async_vs_sync_load`` (information inside ``vllm_ttft_hicache_vs_recompute``; it decided the
  default load mode): the time to first token of a hit with ``async_load`` / with synchronous
  loads, in one engine built with ``async_load`` whose scheduler side switches mode between
  generations (ABBA order), median of the paired ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
PROMPT_TOKENS = 1024
BLOCK = 32
STEP_REQUESTS = 4


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_NO_USAGE_STATS="1",
    )
    return env


def _build_model(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(2044)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(str(path))
    config = LlamaConfig(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1536,
        vocab_size=2048,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    return path


def _prompt(offset: int) -> str:
    return " ".join(f"w{(offset * 131 + 7 * i) % 2044}" for i in range(PROMPT_TOKENS))


def _engine(model: str, connector: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if connector is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache_vllm",
            kv_role="kv_both",
            kv_connector_extra_config=connector,
        )
    return LLM(
        model=model,
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=4096,
        dtype="bfloat16",
        enable_prefix_caching=False,
        **kw,
    )


def _ttft(llm: Any, prompt: str, repeats: int) -> float:
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate([prompt], sampling, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _load_modes(llm: Any, prompt: str, repeats: int) -> dict[str, float]:
    """Time to first token of a hit with synchronous and with asynchronous loads, paired in one
    engine (built with ``async_load``, so its worker has the load thread): the scheduler side's
    mode is switched between generations, in ABBA order; medians, and the median of the
    per-pair ratios async / sync."""
    import dataclasses

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * repeats):
        mode = bool(i % 2) != bool((i // 2) % 2)  # F T T F F T ...
        connector.settings = dataclasses.replace(connector.settings, async_load=mode)
        times[mode].append(_ttft(llm, prompt, 1))
    ratios = [a / s for s, a in zip(times[False], times[True])]
    return {
        "sync_ttft_s": statistics.median(times[False]),
        "async_ttft_s": statistics.median(times[True]),
        "async_vs_sync": statistics.median(ratios),
        "sync_ms_all": [round(t * 1e3, 1) for t in times[False]],
        "async_ms_all": [round(t * 1e3, 1) for t in times[True]],
    }


def _throughput(worker: Any, pages: int, rounds: int) -> dict[str, float]:
    """Connector worker vs CacheController on the same pages: GB/s of the connector (``load``,
    ``save``), of a controller over the same vLLM blocks (``ctl_*``) and of a controller over a
    contiguous pool of its own in the connector's layout and key namespace (``pf_*``); per round all back to back, the order rotating; the
    paired ratios connector / controller; medians over rounds."""
    import torch
    from hicache_vllm import PageOp

    from hicache_core import CacheController, ComponentSpec, HostPool, HostPoolGroup

    pool = worker.pool
    g = pool.geometry
    blocks = list(range(1, pages + 1))
    nbytes = pages * pool.page_nbytes
    own = HostPool(
        [ComponentSpec("kv", g.runs, (g.run_nbytes,), torch.uint8)],
        pages + 1,
        layout=worker.config.layout,
        allocate=False,
    )
    same_cfg = worker.config.model_copy(update={"layout": pool.layout})  # its own key namespace
    out: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        fn()
        out.setdefault(name, []).append(nbytes / (time.perf_counter() - t0) / 1e9)

    with (
        CacheController(same_cfg, HostPoolGroup(pool)) as ctl,
        CacheController(worker.config, HostPoolGroup(own)) as pf,
    ):
        for r in range(rounds):
            h = {k: [f"{k}{r:04d}{i:058x}" for i in range(pages)] for k in ("aa", "bb", "cc")}
            op = PageOp("bench", h["aa"], blocks)
            per = pages // STEP_REQUESTS  # one engine step's saves: STEP_REQUESTS requests' pages
            step = [
                PageOp(f"r{j}", h["aa"][j * per : (j + 1) * per], blocks[j * per : (j + 1) * per])
                for j in range(STEP_REQUESTS)
            ]
            saves = [
                ("save", partial(worker.save, step)),
                ("ctl_save", partial(ctl.backup, h["bb"], blocks)),
                ("pf_save", partial(pf.backup, h["cc"], blocks)),
            ]
            loads = [
                ("load", partial(worker.load, [op])),
                ("ctl_load", partial(ctl.prefetch, h["bb"], blocks)),
                ("pf_load", partial(pf.prefetch, h["aa"], blocks)),  # the connector's pages
            ]
            for group in (saves, loads):
                k = r % len(group)
                for name, fn in group[k:] + group[:k]:
                    timed(name, fn)
            assert not worker.load_errors() and ctl.query(h["bb"]).pages == pages
            for kind in ("load", "save"):
                out.setdefault(f"{kind}_ratio", []).append(out[kind][-1] / out[f"ctl_{kind}"][-1])
                out.setdefault(f"{kind}_pf_ratio", []).append(out[kind][-1] / out[f"pf_{kind}"][-1])
    return {k: statistics.median(v) for k, v in out.items()}


def child(args: dict[str, Any]) -> dict[str, Any]:
    model = str(_build_model(Path(args["model_dir"])))
    connector = args.get("connector")
    llm = _engine(model, connector)
    _ttft(llm, _prompt(999), 1)  # warm-up on another prompt
    result: dict[str, Any] = {}
    prompt = _prompt(1)
    if connector is None:
        result["ttft_s"] = _ttft(llm, prompt, args["repeats"])
        return result
    _ttft(llm, prompt, 1)  # stores the prompt's pages
    result["ttft_s"] = _ttft(llm, prompt, args["repeats"])
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    result["async_load"] = get_kv_transfer_group().settings.async_load
    if args.get("load_modes"):
        result.update(_load_modes(llm, prompt, args["repeats"]))
    if not args.get("pages"):
        return result

    worker = get_kv_transfer_group().worker
    result["stats"] = get_kv_transfer_group().stats().get("transfers")
    result.update(_throughput(worker, args["pages"], args["rounds"]))
    return result


def _run_child(args: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [str(VLLM_PY), str(Path(__file__).resolve()), "--child", json.dumps(args)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench_vllm child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])  # type: ignore[no-any-return]


def _entry(ratio: float, target: float, higher_is_better: bool, **extra: Any) -> dict[str, Any]:
    meets = ratio >= target if higher_is_better else ratio <= target
    return {"ratio": ratio, "target": target, "meets_target": meets, **extra}


def run(quick: bool = False) -> dict[str, Any]:
    if not VLLM_PY.exists():
        raise RuntimeError(".venv-vllm is missing: run `bash integrations/vllm/setup-dev.sh`")
    with tempfile.TemporaryDirectory(prefix="hicache-bench-vllm-") as tmp:
        base = {"model_dir": str(Path(tmp) / "model"), "repeats": 3 if quick else 7}
        recompute = _run_child(base)
        store = {"backend": "file", "options": {"root": str(Path(tmp) / "store")}}
        hicache = _run_child(
            {**base, "connector": store, "pages": 64 if quick else 256, "rounds": 9 if quick else 15}
        )
        # synchronous vs asynchronous loads, paired in one engine
        modes = _run_child(
            {
                **base,
                "connector": {**store, "async_load": True},
                "load_modes": True,
                "repeats": 9 if quick else 15,
            }
        )
    ttft = hicache["ttft_s"] / recompute["ttft_s"]
    sync_ms, async_ms = modes["sync_ttft_s"] * 1e3, modes["async_ttft_s"] * 1e3
    print(
        f"bench_vllm: TTFT hicache {hicache['ttft_s'] * 1e3:.1f} ms vs recompute {recompute['ttft_s'] * 1e3:.1f} ms; "
        f"load {hicache['load']:.2f} vs controller {hicache['ctl_load']:.2f} (own pool "
        f"{hicache['pf_load']:.2f}) GB/s; save {hicache['save']:.2f} vs controller "
        f"{hicache['ctl_save']:.2f} (own pool {hicache['pf_save']:.2f}) GB/s; TTFT hit with "
        f"synchronous loads {sync_ms:.1f} ms, asynchronous loads {async_ms:.1f} ms (paired ratio "
        f"{modes['async_vs_sync']:.2f})"
    )
    return {
        "vllm_ttft_hicache_vs_recompute": _entry(
            ttft,
            0.5,
            False,
            hicache_ms=hicache["ttft_s"] * 1e3,
            recompute_ms=recompute["ttft_s"] * 1e3,
            default_async_load=hicache["async_load"],
            async_vs_sync_load=modes["async_vs_sync"],
            sync_load_ms=sync_ms,
            async_load_ms=async_ms,
        ),
        "vllm_load_vs_controller": _entry(
            hicache["load"] / hicache["ctl_load"],
            0.9,
            True,
            gbps=hicache["load"],
            controller_gbps=hicache["ctl_load"],
        ),
        "vllm_save_vs_controller": _entry(
            hicache["save"] / hicache["ctl_save"],
            0.9,
            True,
            gbps=hicache["save"],
            controller_gbps=hicache["ctl_save"],
        ),
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(json.loads(sys.argv[2]))), flush=True)
    else:
        print(json.dumps(run("--quick" in sys.argv), indent=2))
