"""Run one in-process vLLM engine in a fresh process and print its results as JSON.

Usage: ``python engine_worker.py '<json>'`` with ``model`` (a local model directory),
``prompts`` (a list of prompt strings, served one after another), optional ``connector`` (the
``kv_connector_extra_config`` of a ``HiCacheConnector``; absent: no connector), ``max_tokens``,
``block_size``, ``tensor_parallel_size`` (> 1: one worker process per rank) and
``enable_prefix_caching`` (vLLM's own prefix cache, on by default). Prints one line ``RESULT {...}``: per prompt its token ids, the generated
token ids and text and ``num_cached_tokens``, and the connector's ``stats()``.
"""

from __future__ import annotations

import json
import os
import sys

for key, value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}.items():
    os.environ.setdefault(key, value)


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if args.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache_vllm",
            kv_role="kv_both",
            kv_connector_extra_config=args["connector"],
        )
    tp = args.get("tensor_parallel_size", 1)
    if tp > 1:
        # one worker process per rank, each bound to one CPU (vLLM's automatic binding wants a
        # NUMA node per rank)
        kw.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        cpus = sorted(os.sched_getaffinity(0))
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cpus[i % len(cpus)]) for i in range(tp))
        )
    llm = LLM(
        model=args["model"],
        enforce_eager=True,
        block_size=args.get("block_size", 32),
        max_model_len=1024,
        dtype="bfloat16",
        seed=0,
        enable_prefix_caching=args.get("enable_prefix_caching", True),
        **kw,
    )
    sampling = SamplingParams(temperature=0, max_tokens=args.get("max_tokens", 8))
    results = []
    for prompt in args["prompts"]:
        out = llm.generate([prompt], sampling, use_tqdm=False)[0]
        results.append(
            {
                "prompt_token_ids": list(out.prompt_token_ids or []),
                "token_ids": list(out.outputs[0].token_ids),
                "text": out.outputs[0].text,
                "num_cached_tokens": out.num_cached_tokens,
            }
        )
    stats = None
    if "kv_transfer_config" in kw and tp == 1:  # with tp > 1 the workers are other processes
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        stats = get_kv_transfer_group().stats()
    print("RESULT " + json.dumps({"results": results, "stats": stats}, default=str), flush=True)


if __name__ == "__main__":
    main()
