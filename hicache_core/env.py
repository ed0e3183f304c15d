"""Every ``HICACHE_*`` environment variable that hicache reads: name, type, default, meaning.

Two kinds share the prefix:

* **config** variables set one :class:`~hicache_core.StorageConfig` field each
  (``HICACHE_<FIELD>``, read by :func:`~hicache_core.load_config` and ``StorageConfig.from_env``);
* **switches** steer a part of hicache directly (the registry's allow / block lists, tracing,
  the pure-Python fallbacks, the build, the metrics exporter, the project's own tests).

This module is the single list: config loading accepts exactly these names (an unknown
``HICACHE_*`` name is refused as a likely typo, with a suggestion), switches are read through
:func:`env_flag` / :func:`env_str`, and README.md's table is :func:`markdown_table`'s output
(``tests/core/test_env.py`` holds the two equal). It imports nothing from hicache, so every
layer may use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "CONFIG_VARS",
    "PREFIX",
    "SWITCHES",
    "VARIABLES",
    "EnvVar",
    "env_flag",
    "env_str",
    "markdown_table",
    "suggest",
]

PREFIX: Final = "HICACHE_"


@dataclass(frozen=True)
class EnvVar:
    """One environment variable. ``field`` is the config field it sets (config kind only)."""

    name: str
    kind: Literal["config", "switch"]
    type: str
    default: str
    meaning: str

    @property
    def field(self) -> str:
        return self.name[len(PREFIX) :].lower()


def _config(field: str, type_: str, default: str, meaning: str) -> EnvVar:
    return EnvVar(PREFIX + field.upper(), "config", type_, default, meaning)


def _switch(name: str, type_: str, default: str, meaning: str) -> EnvVar:
    return EnvVar(PREFIX + name, "switch", type_, default, meaning)


CONFIG_VARS: Final[tuple[EnvVar, ...]] = (
    _config("backend", "str", default="file", meaning="backend name (an entry point in `hicache.backends`)"),
    _config("options", "JSON object", "{}", "the backend's options, validated by its `Options` model"),
    _config("model_name", "str", "default", "model identity in the key namespace"),
    _config(
        "model_revision",
        "str",
        "none",
        "weights revision or fingerprint; when set, separates the key namespace (none = unset)",
    ),
    _config(
        "kv_dtype",
        "str",
        "bfloat16",
        "KV dtype in the key namespace (unset: a controller takes its KV pool's dtype)",
    ),
    _config("tp_rank", "int", "0", "tensor-parallel rank"),
    _config("tp_size", "int", "1", "tensor-parallel size"),
    _config("pp_rank", "int", "0", "pipeline-parallel rank"),
    _config("pp_size", "int", "1", "pipeline-parallel size"),
    _config("attn_cp_rank", "int", "0", "attention context-parallel rank"),
    _config("attn_cp_size", "int", "1", "attention context-parallel size"),
    _config("is_mla_model", "bool", "false", "the KV pool is MLA (rank-replicated)"),
    _config("layout", "str", "page_first", "host pool layout: `page_first` or `layer_first`"),
    _config("should_split_heads", "bool", "false", "heads are split across ranks (disables zero-copy draft)"),
    _config("extensions", "comma list", "", "extensions to enable, e.g. `metrics`"),
    _config("enable_storage_metrics", "bool", "false", "shorthand for adding the `metrics` extension"),
    _config("disaggregation_mode", "str", "null", "`null`, `prefill` or `decode`"),
    _config("mamba_scheduler_strategy", "str", "no_buffer", "`no_buffer` or `extra_buffer`"),
    _config("batch_pages", "int", "128", "pages per storage I/O call"),
    _config("prefetch_policy", "str", "best_effort", "`best_effort`, `wait_complete` or `timeout`"),
    _config("prefetch_threshold", "int", "1", "minimum restorable pages worth a prefetch"),
    _config("prefetch_timeout_s", "float", "5.0", "deadline of the `timeout` prefetch policy"),
    _config("io_threads", "int", "2", "threads running async operations"),
    _config("io_timeout_s", "float", "none", "bound on one backend call (none = unbounded)"),
)

SWITCHES: Final[tuple[EnvVar, ...]] = (
    _switch("CONFIG", "path", "", "config file (`.toml`, `.yaml`/`.yml`, `.json`) read by `load_config`"),
    _switch("BACKENDS_ALLOW", "comma list", "", "only these backends may load (any case; `*` = all)"),
    _switch("BACKENDS_BLOCK", "comma list", "", "these backends may not load (any case; `*` = all)"),
    _switch("TRACE", "bool", "0", "log every hook call to the `hicache.trace` logger"),
    _switch("PURE_PYTHON_HASH", "bool", "0", "use the pure-Python page hashing, not the C extension"),
    _switch("PURE_PYTHON_BATCH", "bool", "0", "retired, accepted and ignored: the core has no batch C code"),
    _switch("REQUIRE_NATIVE", "bool", "0", "build: fail when a C extension cannot be compiled"),
    _switch(
        "SKIP_NATIVE",
        "bool",
        "0",
        "build: compile no C extension (a second editable venv on a tree whose extension is built)",
    ),
    _switch("METRICS_PORT", "int", "", "metrics extension: serve Prometheus metrics on this port"),
    _switch("METRICS_ADDR", "str", "127.0.0.1", "metrics extension: address of that exporter"),
    _switch("BENCH_SMOKE", "bool", "0", "benchmarks: a few iterations only (the smoke test)"),
    _switch(
        "PEERS_DIR", "str", "benchmarks/.peers", "peer benchmark: where setup-peers.sh put the peers' venvs"
    ),
    _switch("LONG_TESTS", "bool", "0", "the project's own tests: run the long variants"),
    _switch(
        "KEEP_SERVER_LOGS", "bool", "0", "the project's own tests: keep the logs of the servers they start"
    ),
)

VARIABLES: Final[tuple[EnvVar, ...]] = CONFIG_VARS + SWITCHES
_BY_NAME: Final = {v.name: v for v in VARIABLES}
_FALSE: Final = ("", "0", "false", "no", "off")
_TRUE: Final = ("1", "true", "yes", "on")


def _known(name: str) -> EnvVar:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a hicache environment variable; add it to hicache_core.env") from None


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A boolean switch: unset, empty, ``0``, ``false``, ``no`` or ``off`` (any case) is off;
    ``1``, ``true``, ``yes`` or ``on`` is on; anything else is a :class:`ConfigError`."""
    _known(name)
    env = os.environ if environ is None else environ
    value = env.get(name, "").strip().lower()
    if value in _FALSE:
        return False
    if value in _TRUE:
        return True
    from .errors import ConfigError

    raise ConfigError(
        f"{name}={env.get(name)!r} is not a boolean switch; set it to 1/true/yes/on or 0/false/no/off "
        "(or unset it)"
    )


def env_str(name: str, environ: Mapping[str, str] | None = None) -> str:
    """A switch's value (stripped), or its default when unset or empty."""
    var = _known(name)
    env = os.environ if environ is None else environ
    return env.get(name, "").strip() or var.default


def suggest(name: str) -> str:
    """`` (did you mean HICACHE_X?)`` for a misspelled variable name, else ``""``."""
    import difflib  # an error path only; listing backends does not pay for its import

    close = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def markdown_table() -> str:
    """The README's table of environment variables."""
    rows = ["| variable | kind | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for v in VARIABLES:
        default = f"`{v.default}`" if v.default else ""
        rows.append(f"| `{v.name}` | {v.kind} | {v.type} | {default} | {v.meaning} |")
    return "\n".join(rows)
