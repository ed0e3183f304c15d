"""``StorageConfig``: which backend, its options, the model identity, ranks and controller settings.

Sources, lowest precedence first: a TOML / YAML / JSON file, then ``HICACHE_*`` environment
variables, then explicit keyword overrides (see :func:`load_config`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import env
from .errors import ConfigError
from .types import Layout

__all__ = [
    "ENV_PREFIX",
    "ControllerSettings",
    "PrefetchPolicy",
    "StorageConfig",
    "format_validation_error",
    "load_config",
    "read_config_file",
]

log = logging.getLogger("hicache")

ENV_PREFIX = env.PREFIX


class PrefetchPolicy(str, Enum):
    """When a prefetch is considered done: whatever arrived, everything, or up to a deadline."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"

    def __str__(self) -> str:
        return str(self.value)


class ControllerSettings(BaseModel):
    """Settings of the :class:`~hicache_core.CacheController`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_pages: int = Field(128, ge=1, le=1 << 20, description="pages per storage I/O call")
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_threshold: int = Field(1, ge=0, description="minimum restorable pages worth a prefetch")
    prefetch_timeout_s: float = Field(5.0, gt=0, description="deadline of the 'timeout' policy")
    io_threads: int = Field(2, ge=1, le=256, description="threads running async operations")
    io_timeout_s: float | None = Field(
        None,
        gt=0,
        description=(
            "bound on one backend call; past it the call's pages are reported failed with "
            "BackendTimeoutError and the call is abandoned (None = no bound, no thread hop)"
        ),
    )


_CONTROLLER_FIELDS = frozenset(ControllerSettings.model_fields)


class StorageConfig(BaseModel):
    """Everything needed to open a store and key its pages.

    ``options`` are validated later by the selected backend's ``Options`` model. Controller
    settings may be given nested (``controller={...}``) or flat (``batch_pages=64``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field("file", min_length=1, description="entry-point name in hicache.backends")
    options: dict[str, Any] = Field(default_factory=dict)
    model_name: str = Field("default", min_length=1, max_length=512)
    kv_dtype: str = Field("bfloat16", min_length=1, max_length=64)
    tp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1)
    pp_rank: int = Field(0, ge=0)
    pp_size: int = Field(1, ge=1)
    attn_cp_rank: int = Field(0, ge=0)
    attn_cp_size: int = Field(1, ge=1)
    is_mla_model: bool = False
    layout: Layout = Layout.PAGE_FIRST
    should_split_heads: bool = False
    extensions: list[str] = Field(default_factory=list)
    enable_storage_metrics: bool = False
    disaggregation_mode: Literal["null", "prefill", "decode"] = "null"
    mamba_scheduler_strategy: Literal["no_buffer", "extra_buffer"] = "no_buffer"
    controller: ControllerSettings = Field(default_factory=lambda: ControllerSettings())

    @model_validator(mode="before")
    @classmethod
    def _lift_flat_controller_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and _CONTROLLER_FIELDS & set(data):
            data = dict(data)
            given = data.get("controller") or {}
            if not isinstance(given, Mapping):
                raise ValueError(
                    f"controller must be a mapping of controller settings, got {type(given).__name__}"
                )
            nested = dict(given)
            for name in _CONTROLLER_FIELDS & set(data):
                nested[name] = data.pop(name)
            data["controller"] = nested
        return data

    @field_validator("extensions", mode="before")
    @classmethod
    def _split_extensions(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _check(self) -> StorageConfig:
        for name in ("tp", "pp", "attn_cp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if rank >= size:
                raise ValueError(f"{name}_rank={rank} must be smaller than {name}_size={size}")
        if self.enable_storage_metrics and "metrics" not in self.extensions:
            object.__setattr__(self, "extensions", [*self.extensions, "metrics"])
        if self.disaggregation_mode == "decode" and self.mamba_scheduler_strategy == "extra_buffer":
            log.warning(
                "hicache: disaggregation_mode='decode' uses the chunk cache, so "
                "mamba_scheduler_strategy 'extra_buffer' is changed to 'no_buffer'"
            )
            object.__setattr__(self, "mamba_scheduler_strategy", "no_buffer")
        return self

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> StorageConfig:
        """Load from a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file (environment ignored)."""
        return _build({**read_config_file(Path(path)), **overrides}, source=str(path))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> StorageConfig:
        """File (``path`` or ``$HICACHE_CONFIG``), then ``HICACHE_*`` variables, then overrides;
        the same as :func:`load_config`."""
        return load_config(path, environ, **overrides)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> StorageConfig:
        """Build from ``HICACHE_*`` variables only (no file)."""
        return _build({**_read_env(os.environ if environ is None else environ), **overrides}, source="env")


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> StorageConfig:
    """Merge a config file (``path`` or ``$HICACHE_CONFIG``), ``HICACHE_*`` variables and overrides.

    Environment variables are named after the fields: ``HICACHE_BACKEND``, ``HICACHE_MODEL_NAME``,
    ``HICACHE_TP_RANK``, ``HICACHE_BATCH_PAGES``...; ``HICACHE_OPTIONS`` holds JSON and
    ``HICACHE_EXTENSIONS`` a comma-separated list. An unknown ``HICACHE_*`` name is an error
    (it is almost always a typo).
    """
    environ_ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    source = "env"
    file = path if path is not None else environ_.get(ENV_PREFIX + "CONFIG")
    if file:
        data.update(read_config_file(Path(file)))
        source = str(file)
    env_data = _read_env(environ_)
    if isinstance(env_data.get("options"), dict) and isinstance(data.get("options"), dict):
        env_data["options"] = {**data["options"], **env_data["options"]}
    data.update(env_data)
    data.update(overrides)
    return _build(data, source=source)


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem: ``field.path: message (got value)``."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        got = e.get("input")
        got_s = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        lines.append(f"  {prefix}{loc}: {e['msg']}{got_s}")
    return "\n".join(lines)


def _build(data: Mapping[str, Any], *, source: str) -> StorageConfig:
    try:
        return StorageConfig.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(
            f"invalid hicache config from {source}:\n{format_validation_error(err)}\n"
            f"Valid fields: {sorted(StorageConfig.model_fields)} and controller fields "
            f"{sorted(_CONTROLLER_FIELDS)}"
        ) from None


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read hicache config file {path}: {err.strerror or err}") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data: Any = _toml_loads(text.decode("utf-8"))
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(
                f"config file {path}: unknown format {suffix!r}; use .toml, .yaml, .yml or .json"
            )
    except ConfigError:
        raise
    except Exception as err:  # parser errors of three libraries
        raise ConfigError(f"config file {path} is not valid {suffix[1:].upper()}: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level, got {type(data).__name__}")
    if "hicache" in data and isinstance(data["hicache"], dict) and len(data) == 1:
        data = data["hicache"]  # allow a [hicache] table / top-level key
    return dict(data)


def _toml_loads(text: str) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


def _read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The config fields set by ``HICACHE_<FIELD>`` variables (:data:`hicache_core.env.CONFIG_VARS`).

    Switches (:data:`hicache_core.env.SWITCHES`) are skipped; any other ``HICACHE_*`` name is
    refused, since it is almost always a typo.
    """
    config_vars = {v.name: v.field for v in env.CONFIG_VARS}
    switches = {v.name for v in env.SWITCHES}
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in switches:
            continue
        field = config_vars.get(name)
        if field is None:
            raise ConfigError(
                f"unknown environment variable {name}{env.suggest(name)}; hicache reads the variables "
                "listed in hicache_core.env (README: Environment variables): config fields "
                f"{sorted(config_vars)} and switches {sorted(switches)}"
            )
        if field == "options":
            try:
                value: Any = json.loads(raw)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{name} must be a JSON object: {err}") from None
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
            out[field] = value
        elif field == "io_timeout_s" and raw.strip().lower() in ("", "none"):
            out[field] = None
        else:
            out[field] = raw
    return out
