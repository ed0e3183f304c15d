"""Translate vLLM's ``kv_connector_extra_config`` (and vLLM's own config) into a ``StorageConfig``.

The extra config is a JSON object with either

``config``
    the path of a hicache config file (TOML, YAML or JSON; the same file ``hicache`` reads), or
``backend`` and ``options``
    a backend name (an entry point in ``hicache.backends``, e.g. ``"file"``) and its options,

plus, optionally, the other operator fields of :class:`hicache_core.StorageConfig`:
``model_revision``, ``extensions``, ``enable_storage_metrics`` (default true: the connector
reports hits, misses, bytes and load/save time through the ``metrics`` extension) and the
controller settings (``batch_pages``...). Given both, the keys of the extra config override the
file's. ``async_save`` (default false) moves saves to a background thread; vLLM then keeps a
finished request's blocks until its saves are done (``get_finished``). ``async_load`` (default
false) moves loads to a background thread: the scheduler answers ``(tokens, True)``, the request
waits outside the batch until the worker reports its load done (``get_finished``), and failed
pages are reported through ``get_block_ids_with_load_errors`` and recomputed.

The sources merge as everywhere in hicache (``hicache_core.load_config``), lowest precedence
first: the config file (``config``, else ``$HICACHE_CONFIG``), then the ``HICACHE_<FIELD>``
environment variables (``HICACHE_BACKEND``, ``HICACHE_OPTIONS``, ``HICACHE_BATCH_PAGES``...; an
unknown ``HICACHE_*`` name is an error with a "did you mean"), then the extra config.

The fields that decide which pages may be shared are set by the connector from vLLM's config and
are refused in every source (extra config, file, environment): ``model_name`` (the served model
plus the page byte format), ``kv_dtype``, ``tp_*``/``pp_*``/``attn_cp_*``, ``layout``,
``is_mla_model`` and ``should_split_heads``. SGLang's ``disaggregation_mode`` and
``mamba_scheduler_strategy`` have no meaning in vLLM and are refused too. ``model_revision``
defaults to vLLM's ``--revision``.

Every key is checked when the connector is built: an unknown key, a wrong type or an invalid
value raises :class:`hicache_core.ConfigError` naming the key.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache_core import ConfigError, ControllerSettings, Layout, StorageConfig
from hicache_core.config import ENV_PREFIX, merge_config_layers, read_config_file, redact_secrets

__all__ = [
    "CONNECTOR_KEYS",
    "DERIVED_FIELDS",
    "ENGINE_FIELDS",
    "EXTRA_KEYS",
    "SGLANG_FIELDS",
    "ConnectorSettings",
    "PageFormat",
    "parse_extra_config",
    "storage_config",
]

# StorageConfig fields the connector derives from vLLM (never from the operator).
DERIVED_FIELDS = frozenset(
    {
        "model_name",
        "kv_dtype",
        "tp_rank",
        "tp_size",
        "pp_rank",
        "pp_size",
        "attn_cp_rank",
        "attn_cp_size",
        "layout",
        "is_mla_model",
        "should_split_heads",
    }
)
# SGLang settings (PD disaggregation, Mamba scheduling) that mean nothing to vLLM.
SGLANG_FIELDS = frozenset({"disaggregation_mode", "mamba_scheduler_strategy"})
ENGINE_FIELDS = DERIVED_FIELDS | SGLANG_FIELDS
_OPERATOR_FIELDS = frozenset(StorageConfig.model_fields) - ENGINE_FIELDS
_CONTROLLER_FIELDS = frozenset(ControllerSettings.model_fields)
CONNECTOR_KEYS = frozenset({"config", "async_save", "async_load"})
EXTRA_KEYS = CONNECTOR_KEYS | _OPERATOR_FIELDS | _CONTROLLER_FIELDS


@dataclass(frozen=True)
class ConnectorSettings:
    """The operator's part of the hicache config (validated; engine fields not yet set)."""

    fields: dict[str, Any]
    async_save: bool = False
    async_load: bool = False

    @property
    def backend(self) -> str:
        return str(self.fields["backend"])

    def __repr__(self) -> str:  # credentials in the options are never shown
        return (
            f"ConnectorSettings(fields={redact_secrets(self.fields)!r}, async_save={self.async_save}, "
            f"async_load={self.async_load})"
        )


@dataclass(frozen=True)
class PageFormat:
    """What the bytes of one stored page mean; it namespaces the keys (``model_name``)."""

    model: str
    revision: str | None
    kv_dtype: str
    device: str
    layout: str
    block_size: int
    num_layers: int
    is_mla: bool
    tp_size: int
    pp_size: int
    cp_sharded: bool = False  # context parallelism spreads a block's tokens over the ranks

    @property
    def rank_replicated(self) -> bool:
        """MLA's latent KV is the same on every tensor-parallel rank (one key per page, which
        rank 0 writes), unless context parallelism gives each rank other tokens of the block."""
        return self.is_mla and not self.cp_sharded

    def model_name(self) -> str:
        """``{model}@vllm:{device}:{layout}:bs{block}:L{layers}``: pages of another engine, layout,
        block size or layer count never share keys with these."""
        return (
            f"{self.model}@vllm:{self.device}:{self.layout}:bs{self.block_size}:L{self.num_layers}"
            f"{':mla' if self.is_mla else ''}"
        )


def _refused(fields: list[str], where: str, fix: str) -> ConfigError:
    """The error for engine fields given by the operator: what sets each one instead."""
    derived = [f for f in fields if f in DERIVED_FIELDS]
    sglang = [f for f in fields if f in SGLANG_FIELDS]
    what = []
    if derived:
        what.append(
            f"{derived} are set by the connector from vLLM's own config (served model, KV dtype, "
            "parallel ranks, KV layout)"
        )
    if sglang:
        what.append(f"{sglang} are SGLang settings that the vLLM connector does not use")
    return ConfigError(f"hicache-vllm: {where}: {'; '.join(what)}; {fix}")


def parse_extra_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Validate vLLM's ``kv_connector_extra_config`` merged over the config file and the
    ``HICACHE_*`` variables of ``environ`` (default ``os.environ``); see the module docstring."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError(
            f"hicache-vllm: kv_connector_extra_config must be a JSON object, got {type(extra).__name__}"
        )
    if environ is None:
        environ = os.environ
    for key in extra:
        if not isinstance(key, str):
            raise ConfigError(
                f"hicache-vllm: kv_connector_extra_config keys must be strings, got {key!r:.80}"
            )
    engine = sorted(k for k in extra if k in ENGINE_FIELDS)
    if engine:
        raise _refused(
            engine,
            "kv_connector_extra_config",
            "remove them (use 'model_revision' to separate two checkpoints served under one name)",
        )
    unknown = sorted(k for k in extra if k not in EXTRA_KEYS)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(EXTRA_KEYS), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"hicache-vllm: unknown kv_connector_extra_config key(s) {', '.join(hints)}; the connector "
            f"reads {sorted(EXTRA_KEYS)}"
        )
    engine_vars = sorted(ENV_PREFIX + f.upper() for f in ENGINE_FIELDS if ENV_PREFIX + f.upper() in environ)
    if engine_vars:
        raise _refused(
            sorted(v[len(ENV_PREFIX) :].lower() for v in engine_vars),
            f"the environment sets {engine_vars}",
            "unset them for vLLM",
        )
    # The HICACHE_* layer, field by field as hicache_core.load_config reads it (an unknown name is
    # a ConfigError with a "did you mean"); only the variables given, not the defaults.
    env_layer = StorageConfig.from_env(environ).model_dump(exclude_unset=True)
    data: dict[str, Any] = {}
    given: dict[str, Any] = {}
    path = extra.get("config")
    if path is None and environ.get(ENV_PREFIX + "CONFIG"):
        path = environ[ENV_PREFIX + "CONFIG"]
    if path is not None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError(
                "hicache-vllm: 'config' must be the path of a hicache config file (.toml, .yaml, .json), "
                f"got {path!r:.80}"
            )
        data.update(read_config_file(path))
        bad = sorted(k for k in data if k in ENGINE_FIELDS)
        if bad:
            raise _refused(bad, f"the hicache config file {str(path)!r}", "remove them from the file")
    elif "backend" not in extra and "backend" not in env_layer:
        raise ConfigError(
            "hicache-vllm: kv_connector_extra_config must name a hicache backend or a config file, e.g. "
            '{"backend": "file", "options": {"root": "/var/cache/hicache"}} or '
            '{"config": "/etc/hicache.toml"} (or set HICACHE_CONFIG / HICACHE_BACKEND; list the '
            "installed backends with `hicache backends`)"
        )
    flags = {}
    for key in ("async_save", "async_load"):
        flags[key] = extra.get(key, False)
        if not isinstance(flags[key], bool):
            raise ConfigError(f"hicache-vllm: {key!r} must be true or false, got {flags[key]!r:.80}")
    for key, value in extra.items():
        if key in CONNECTOR_KEYS:
            continue
        if key == "backend" and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(
                f"hicache-vllm: 'backend' must be a backend name such as 'file', got {value!r:.80}"
            )
        if key == "options":
            if not isinstance(value, Mapping):  # [], "", 0, null: never silently the default root
                raise ConfigError(
                    "hicache-vllm: 'options' must be a JSON object of the backend's options, e.g. "
                    f'{{"root": "/var/cache/hicache"}}, got {type(value).__name__} {value!r:.80}'
                )
        given[key] = value
    # The file, the environment, then the extra config: options and controller settings merge
    # one by one.
    data = merge_config_layers(
        (str(path), data),
        ("HICACHE_* environment variables", env_layer),
        ("kv_connector_extra_config", given),
    )
    # Metrics are on unless the operator turns them off: the connector reports through them.
    data.setdefault("enable_storage_metrics", True)
    # Validate every operator field now (engine fields get placeholders), naming the key.
    try:
        StorageConfig.model_validate(data)
    except ConfigError as err:
        raise ConfigError(f"hicache-vllm: invalid kv_connector_extra_config: {err}") from None
    return ConnectorSettings(data, flags["async_save"], flags["async_load"])


def storage_config(
    settings: ConnectorSettings,
    page: PageFormat,
    *,
    tp_rank: int,
    pp_rank: int,
    layout: Layout = Layout.LAYER_FIRST,
) -> StorageConfig:
    """The ``StorageConfig`` of one vLLM rank: the operator's fields plus the engine's.

    ``layout`` is the layout of the worker's pool over vLLM's KV cache (the workers report it to
    the scheduler; vLLM's CPU ``LBHNC`` cache gives ``layer_first``): it names the key namespace."""
    data = dict(settings.fields)
    if data.get("model_revision") is None and page.revision is not None:
        data["model_revision"] = page.revision
    data.update(
        model_name=page.model_name(),
        kv_dtype=page.kv_dtype,
        tp_rank=tp_rank,
        tp_size=page.tp_size,
        pp_rank=pp_rank,
        pp_size=page.pp_size,
        is_mla_model=page.rank_replicated,
        layout=layout,
    )
    try:
        return StorageConfig.model_validate(data)
    except ConfigError as err:
        raise ConfigError(f"hicache-vllm: cannot build the hicache config for vLLM: {err}") from None
