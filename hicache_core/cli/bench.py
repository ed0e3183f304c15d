"""``hicache bench``: back a model profile up, reopen in a fresh process, verify every byte.

Reports GB/s of backup and prefetch through the :class:`~hicache_core.CacheController` and the
ratio to a raw baseline measured in the same run (file I/O for the file backend, memcpy
otherwise). Exit status 0 only when every byte verified. This module stays import-light; the
work lives in :mod:`hicache_core.bench`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["add_arguments", "parse_options", "run"]

_MODELS = ("llama3-8b", "deepseek-v3", "qwen3-next", "deepseek-v3.2")
_MODEL_HELP = (
    "model profile: llama3-8b (MHA), deepseek-v3 (MLA), qwen3-next (hybrid KV + Mamba), "
    "deepseek-v3.2 (MLA + DSA indexer); default llama3-8b"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="hicache config file (.toml/.yaml/.json; default $HICACHE_CONFIG), read like every other "
        "entry point: the file, then HICACHE_* variables, then --backend/--options. The model identity "
        "(name, dtype, ranks, layout) comes from --model",
    )
    parser.add_argument(
        "--backend", default=None, metavar="NAME", help="backend name (default: the config's, else file)"
    )
    parser.add_argument(
        "--options",
        metavar="JSON|@FILE",
        help="backend options as JSON, or @path to a .json/.toml/.yaml file, merged over the config's. "
        "Every path option left unset gets a fresh temporary path, removed afterwards",
    )
    parser.add_argument("--model", default="llama3-8b", choices=_MODELS, metavar="PROFILE", help=_MODEL_HELP)
    parser.add_argument(
        "--draft",
        action="store_true",
        help="add a draft (speculative decoding) KV pool, if the backend allows",
    )
    parser.add_argument(
        "--pages", type=_positive, default=256, metavar="N", help="KV pages to move (default 256)"
    )
    parser.add_argument(
        "--repeat",
        type=_positive,
        default=2,
        metavar="R",
        help="timed rounds, each hicache phase interleaved with its raw baseline; the best of each "
        "is reported. Each round backs up fresh keys, so the store holds R x the bytes (default 2)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the random pages and tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object (no progress bar)")
    parser.add_argument(
        "--metrics", action="store_true", help="enable the 'metrics' extension and print its snapshot"
    )


def _positive(text: str) -> int:
    """A count flag's value (argparse names the flag in front of this message)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer such as 64, got {text!r}")
    return value


def parse_options(text: str | None) -> dict[str, Any] | None:
    """``--options``: inline JSON, or ``@path`` to a JSON/TOML/YAML file; must be an object."""
    if text is None:
        return None
    if text.startswith("@"):
        from ..config import read_config_file

        return read_config_file(Path(text[1:]))
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f'--options is not valid JSON ({err}); pass an object such as \'{{"root": "/tmp/x"}}\' '
            "or @path/to/options.json"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"--options must be a JSON object, got {type(value).__name__}")
    return value


def load_bench_config(args: argparse.Namespace) -> tuple[Any, str]:
    """The ``StorageConfig`` of ``--config`` / ``$HICACHE_CONFIG``, ``HICACHE_*`` variables and
    ``--backend`` / ``--options`` (merged over the config's options, unless ``--backend`` names
    another backend than the config's), and where it came from."""
    import os

    from ..config import ENV_PREFIX, load_config
    from ..env import CONFIG_VARS

    overrides: dict[str, Any] = {}
    if args.backend:
        overrides["backend"] = args.backend
    options = parse_options(args.options)
    if options is not None:
        overrides["options"] = options
    # load_config merges the options key by key, dropping the config's when --backend differs
    config = load_config(args.config, **overrides)
    file = args.config or os.environ.get(ENV_PREFIX + "CONFIG") or None
    env = [v.name for v in CONFIG_VARS if v.name in os.environ]
    sources = [f"config {file}"] if file else []
    sources += ["HICACHE_* environment"] if env else []
    sources += ["command line"] if overrides else []
    return config, " + ".join(sources) or "defaults"


def run(args: argparse.Namespace) -> int:
    from ..bench import BenchRequest, render, run_bench

    config, source = load_bench_config(args)
    report = run_bench(
        BenchRequest(
            backend=config.backend,
            options=dict(config.options),
            model=args.model,
            draft=args.draft,
            pages=args.pages,
            metrics=args.metrics,
            seed=args.seed,
            rounds=args.repeat,
            progress=not args.json,
            config=config,
            config_source=source,
        )
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    return 0 if report["verified"] else 1
