"""``StorageConfig``: which backend, its options, the model identity, ranks and controller settings.

Sources, lowest precedence first: a TOML / YAML / JSON file, then ``HICACHE_*`` environment
variables, then explicit keyword overrides (see :func:`load_config`).

Every way of building a config (``StorageConfig(...)``, ``model_validate``, ``model_copy(update=...)``,
the loaders) raises :class:`~hicache_core.ConfigError` naming the field for an invalid value; a
pydantic ``ValidationError`` never escapes. Durations are finite, positive and at most
:data:`MAX_TIMEOUT_S`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import stat
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import env
from .errors import ArgumentTypeError, ConfigError
from .types import Layout

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Self

__all__ = [
    "ENV_PREFIX",
    "MAX_CONFIG_FILE_BYTES",
    "MAX_MODEL_REVISION_LEN",
    "MAX_TIMEOUT_S",
    "ControllerSettings",
    "PrefetchPolicy",
    "StorageConfig",
    "expand_path",
    "format_validation_error",
    "is_secret_name",
    "load_config",
    "merge_config_layers",
    "read_config_file",
    "read_small_file",
    "redact_secrets",
    "redact_userinfo",
]

# Config and options files are small: a larger one (or /dev/zero) is refused before parsing.
MAX_CONFIG_FILE_BYTES = 4 << 20
_UNSET_VAR = re.compile(r"\$(\w+|\{[^}]*\})")
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SECRET_NAME = re.compile(r"key|secret|token|passw(?:or)?d|credential|auth", re.IGNORECASE)
# The ``user:password@`` part of a URL (``scheme://user:pw@host``, or ``user:pw@host`` bare).
_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s]+@|(?<![\w.:/-])[^\s/?#@:'\"]+:[^\s/?#@'\"]*@"
)
log = logging.getLogger("hicache")

ENV_PREFIX = env.PREFIX
MAX_TIMEOUT_S = 86_400.0
"""Upper bound of every duration setting (one day): a longer wait is a misconfiguration, and an
unbounded one (``inf``) would only fail later, inside I/O, with ``OverflowError``."""
MAX_MODEL_REVISION_LEN = 256
_MAX_SIZE = 1 << 16  # bound of the tp / pp / attn-cp sizes (keys stay short)


class PrefetchPolicy(str, Enum):
    """When a prefetch is considered done: whatever arrived, everything, or up to a deadline."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"

    def __str__(self) -> str:
        return str(self.value)


class _Checked(BaseModel):
    """A model whose constructors raise :class:`ConfigError` (naming the field), never pydantic's
    ``ValidationError``."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise _config_error(err, type(self).__name__) from None

    # Behaves as pydantic's own __init__ (only the exception type differs), so pydantic must not
    # route nested validation through it (it would wrap ConfigError in a ValidationError); this
    # is the marker pydantic's RootModel uses for the same purpose.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        return cls._checked_validate(obj, f"{cls.__name__}.model_validate", **kwargs)

    @classmethod
    def _checked_validate(cls, obj: Any, source: str, **kwargs: Any) -> Self:
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as err:
            raise _config_error(err, source) from None

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as err:
            raise _config_error(err, f"{cls.__name__}.model_validate_json") from None

    @classmethod
    def model_validate_strings(cls, obj: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate_strings(obj, **kwargs)
        except ValidationError as err:
            raise _config_error(err, f"{cls.__name__}.model_validate_strings") from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy whose ``update`` is VALIDATED (pydantic's would take any value): ConfigError."""
        if update is not None and not isinstance(update, Mapping):
            raise ArgumentTypeError(f"model_copy: update must be a mapping, got {type(update).__name__}")
        if not update:
            return super().model_copy(deep=deep)
        data = {**self.model_dump(), **update}
        if isinstance(data.get("controller"), Mapping) and "controller" not in update:  # flat settings
            data["controller"] = {k: v for k, v in data["controller"].items() if k not in update}
        return type(self)._checked_validate(data, f"{type(self).__name__}.model_copy")


class ControllerSettings(_Checked):
    """Settings of the :class:`~hicache_core.CacheController`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_pages: int = Field(128, ge=1, le=1 << 20, description="pages per storage I/O call")
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_threshold: int = Field(1, ge=0, description="minimum restorable pages worth a prefetch")
    prefetch_timeout_s: float = Field(
        5.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="deadline of the 'timeout' policy"
    )
    io_threads: int = Field(2, ge=1, le=256, description="threads running async operations")
    io_timeout_s: float | None = Field(
        None,
        gt=0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description=(
            "bound on one backend call; past it the call's pages are reported failed with "
            "BackendTimeoutError and the call is abandoned (None = no bound, no thread hop)"
        ),
    )


_CONTROLLER_FIELDS = frozenset(ControllerSettings.model_fields)


class StorageConfig(_Checked):
    """Everything needed to open a store and key its pages.

    ``options`` are validated later by the selected backend's ``Options`` model. Controller
    settings may be given nested (``controller={...}``) or flat (``batch_pages=64``).

    ``model_revision`` (a weights revision or fingerprint, e.g. a commit hash) separates the key
    namespace when set: two checkpoints published under one ``model_name`` never share pages.
    Unset (the default), the keys are exactly those of a config without the field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field("file", min_length=1, description="entry-point name in hicache.backends")
    options: dict[str, Any] = Field(default_factory=dict)
    model_name: str = Field("default", min_length=1, max_length=512)
    model_revision: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_MODEL_REVISION_LEN,
        description="weights revision or fingerprint; when set it separates the key namespace",
    )
    kv_dtype: str = Field("bfloat16", min_length=1, max_length=64)
    tp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1, le=_MAX_SIZE)
    pp_rank: int = Field(0, ge=0)
    pp_size: int = Field(1, ge=1, le=_MAX_SIZE)
    attn_cp_rank: int = Field(0, ge=0)
    attn_cp_size: int = Field(1, ge=1, le=_MAX_SIZE)
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
        return _nest_controller(data) if isinstance(data, Mapping) else data

    def __repr_args__(self) -> Any:
        # A config is logged and shown in errors: credentials in its options never are.
        for name, value in super().__repr_args__():
            yield name, redact_secrets(value) if name == "options" else value

    @field_validator("model_name", "kv_dtype", "model_revision")
    @classmethod
    def _printable_identity(cls, value: str | None, info: Any) -> str | None:
        # These fields name the key namespace (paging/keys.py): a control character (NUL above
        # all, the separator of the namespace's identity string) could make two different
        # configs name one namespace, and so read each other's pages.
        if value is not None and _CONTROL_CHARS.search(value):
            raise ValueError(
                f"{info.field_name} must not contain control characters (NUL, newline, tab, ...); "
                f"got {value!r:.80}: use printable text"
            )
        return value

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
                "mamba_scheduler_strategy 'extra_buffer' is changed to 'no_buffer' (size the Mamba pool "
                "with extra_buffer=True: MambaPool.for_node / sizing.decode_mamba_pool_size)"
            )
            object.__setattr__(self, "mamba_scheduler_strategy", "no_buffer")
        return self

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> StorageConfig:
        """Load from a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file (environment ignored)."""
        file = _as_path(path, "StorageConfig.from_file: path")
        layers = [(str(file), read_config_file(file)), ("keyword arguments", overrides)]
        return _build(merge_config_layers(*layers), source=str(file))

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
        environ_ = _as_environ(environ, "StorageConfig.from_env")
        layers = [("HICACHE_* environment variables", _read_env(environ_)), ("keyword arguments", overrides)]
        return _build(merge_config_layers(*layers), source="env")


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
    environ_ = _as_environ(environ, "load_config")
    layers: list[tuple[str, Mapping[str, Any]]] = []
    source = "env"
    if path is not None:
        file: Path | None = _as_path(path, "load_config: path")
    else:
        raw = environ_.get(ENV_PREFIX + "CONFIG")
        file = _as_path(raw, ENV_PREFIX + "CONFIG") if raw else None
    if file is not None:
        source = str(file)
        layers.append((source, read_config_file(file)))
    layers.append(("HICACHE_* environment variables", _read_env(environ_)))
    layers.append(("keyword arguments", overrides))
    return _build(merge_config_layers(*layers), source=source)


def merge_config_layers(*layers: tuple[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One config mapping from ``(source, mapping)`` layers, lowest precedence first (a file, the
    ``HICACHE_*`` variables, keyword arguments): every entry point merges this way.

    A later layer's value replaces an earlier one's, except that ``options`` merge key by key
    (unless the later layer names another ``backend``: the earlier options belonged to the
    earlier backend and are dropped) and controller settings merge setting by setting, whether
    given flat (``batch_pages``) or nested (``controller.batch_pages``). One layer giving a
    setting both ways is a :class:`ConfigError` naming the setting and the layer."""
    out: dict[str, Any] = {}
    for source, layer in layers:
        if not isinstance(layer, Mapping):
            raise ConfigError(f"{source} must be a mapping of config fields, got {type(layer).__name__}")
        try:
            data = _nest_controller(layer)
        except ValueError as err:
            raise ConfigError(f"invalid hicache config from {source}: {err}") from None
        default = StorageConfig.model_fields["backend"].default
        backend = data.get("backend", out.get("backend", default))
        if backend != out.get("backend", default):
            out.pop("options", None)
        for key, value in data.items():
            merge = key in ("options", "controller") and isinstance(out.get(key), Mapping)
            out[key] = {**out[key], **value} if merge and isinstance(value, Mapping) else value
    return out


def _nest_controller(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with flat controller settings moved under ``controller`` (ValueError: given both ways)."""
    out = dict(data)
    nested = out.get("controller")
    if isinstance(nested, BaseModel):  # a ControllerSettings: only the settings it was given
        out["controller"] = nested = nested.model_dump(exclude_unset=True)
    flat = sorted(_CONTROLLER_FIELDS & set(out))
    nested = {} if nested is None else nested
    if flat and not isinstance(nested, Mapping):
        raise ValueError(f"controller must be a mapping of controller settings, got {type(nested).__name__}")
    for name in (n for n in flat if n in nested):
        raise ValueError(
            f"{name} is given twice, flat ({_short_repr(out[name])}) and under controller "
            f"({_short_repr(nested[name])}); give it once"
        )
    if flat:
        out["controller"] = {**nested, **{name: out.pop(name) for name in flat}}
    return out


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem: ``field.path: message (got value)``. No value is shown for an unknown
    (extra) key or a field :func:`is_secret_name` flags, so a secret put in the wrong place is not
    echoed into logs; a URL shown loses its ``user:password@``."""
    lines = []
    for e in err.errors():
        parts = [str(p) for p in e["loc"]]
        loc = ".".join(parts) or "<root>"
        got, msg = e.get("input"), str(e["msg"])
        if e["type"] == "extra_forbidden" or any(is_secret_name(p) for p in parts):
            if isinstance(got, str) and got:  # a validator that quoted the value
                msg = msg.replace(repr(got)[1:-1], "***").replace(got, "***")
            got_s = " (value not shown)"
        elif isinstance(got, (dict, list)):
            got_s = ""
        else:
            got_s = f" (got {_short_repr(redact_userinfo(got) if isinstance(got, str) else got)})"
        lines.append(f"  {prefix}{loc}: {redact_userinfo(msg)}{got_s}")
    return "\n".join(lines)


def is_secret_name(name: str) -> bool:
    """Whether ``name`` (a field or option) names a credential: it contains key, secret, token,
    password, passwd, credential or auth (any case). Such values are never shown."""
    return bool(_SECRET_NAME.search(name))


def redact_userinfo(text: str) -> str:
    """``text`` with the ``user:password@`` part of every URL in it replaced by ``***@``."""
    return _USERINFO.sub(lambda m: f"{m.group('scheme') or ''}***@", text)


def redact_secrets(value: Any) -> Any:
    """A copy of ``value`` (nested mappings, lists, strings) fit to show: the value of every key
    that :func:`is_secret_name` flags becomes ``"***"``, and URLs lose their ``user:password@``."""
    if isinstance(value, Mapping):
        return {
            k: "***" if isinstance(k, str) and is_secret_name(k) else redact_secrets(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(redact_secrets(v) for v in value)
    return redact_userinfo(value) if isinstance(value, str) else value


def _short_repr(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _config_error(err: ValidationError, source: str) -> ConfigError:
    return ConfigError(
        f"invalid hicache config from {source}:\n{format_validation_error(err)}\n"
        f"Valid fields: {sorted(StorageConfig.model_fields)} and controller fields "
        f"{sorted(_CONTROLLER_FIELDS)}"
    )


def _build(data: Mapping[str, Any], *, source: str) -> StorageConfig:
    return StorageConfig._checked_validate(dict(data), source)


def _as_path(value: object, what: str) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{what} must be a str or os.PathLike path, got {type(value).__name__}")
    try:
        return Path(value)
    except (TypeError, ValueError) as err:  # a PathLike whose __fspath__ returns a non-str
        raise ArgumentTypeError(f"{what} is not a usable path: {err}") from None


def _as_environ(environ: object, what: str) -> Mapping[str, str]:
    if environ is None:
        return os.environ
    if not isinstance(environ, Mapping):
        raise ArgumentTypeError(
            f"{what}: environ must be a mapping of variable names to strings (like os.environ), "
            f"got {type(environ).__name__}"
        )
    return environ


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping held by a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file (a single top-level
    ``hicache`` table is unwrapped); :class:`ConfigError` when it cannot be read or parsed."""
    path = _as_path(path, "read_config_file: path")
    try:
        text = read_small_file(path)
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path, not a small regular file
        raise ConfigError(
            f"cannot read hicache config file {path}: {getattr(err, 'strerror', None) or err}"
        ) from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data: Any = _toml_loads(text.decode("utf-8"))
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.load(text, Loader=_unique_key_yaml_loader())  # a SafeLoader
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_json_object)
        else:
            raise ConfigError(
                f"config file {path}: unknown format {suffix!r}; use .toml, .yaml, .yml or .json"
            )
    except ConfigError:
        raise
    except _DuplicateKey as err:  # TOML refuses these itself; JSON and YAML parsers keep the last
        raise ConfigError(
            f"config file {path}: the key {err.args[0]!r} appears twice{err.args[1]} in one mapping; "
            "keep one (JSON and YAML parsers would silently keep the last)"
        ) from None
    except Exception as err:  # parser errors of three libraries
        raise ConfigError(f"config file {path} is not valid {suffix[1:].upper()}: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level, got {type(data).__name__}")
    if "hicache" in data and isinstance(data["hicache"], dict) and len(data) == 1:
        data = data["hicache"]  # allow a [hicache] table / top-level key
    return dict(data)


class _DuplicateKey(Exception):
    """A key given twice in one mapping of a JSON or YAML file: ``args == (key, where)``."""


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key, "")
        out[key] = value
    return out


@functools.cache
def _unique_key_yaml_loader() -> Any:
    """PyYAML's ``SafeLoader`` refusing a scalar key given twice in one mapping (a ``<<`` merge key
    may still be overridden, as YAML allows)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[tuple[str, str]] = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if (key.tag, key.value) in seen:
                        raise _DuplicateKey(key.value, f" (line {key.start_mark.line + 1})")
                    seen.add((key.tag, key.value))
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def expand_path(value: str, field: str = "root") -> str:
    """``value`` with ``~`` and ``$VARS`` expanded, made absolute: for a backend's path options.

    Raises :class:`ValueError` naming ``field`` for an empty path, a NUL byte, or an environment
    variable that is not set (``os.path.expandvars`` would leave ``$VAR`` in the path, and a
    directory literally named ``$VAR`` would be created under the working directory)."""
    if not value.strip() or "\0" in value:
        raise ValueError(f"{field} must be a non-empty path without NUL bytes")
    expanded = os.path.expandvars(value)
    unset = _UNSET_VAR.search(expanded)
    if unset:
        name = unset.group(1).strip("{}")
        raise ValueError(
            f"{field} {value!r}: the environment variable ${name} is not set; set it or give the path"
        )
    home = os.path.expanduser(expanded)
    if home.startswith("~"):  # ~name of a user this system does not know: left as is
        raise ValueError(f"{field} {value!r}: no such user's home directory; give the path")
    return os.path.abspath(home)


def read_small_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a regular file of at most :data:`MAX_CONFIG_FILE_BYTES`.

    Raises :class:`OSError` when it cannot be opened, :class:`ValueError` when it is not a
    regular file (a FIFO, a device such as ``/dev/zero``: never blocks, never reads without end)
    or is larger than the limit."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO's open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        chunks, size = [], 0
        while size <= MAX_CONFIG_FILE_BYTES:
            chunk = os.read(fd, MAX_CONFIG_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > MAX_CONFIG_FILE_BYTES:
        raise ValueError(f"larger than {MAX_CONFIG_FILE_BYTES >> 20} MiB; a config or options file is small")
    return b"".join(chunks)


def _toml_loads(text: str) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


# Fields whose default is None: their variable empty or ``none`` (any case) leaves them unset.
_ALL_FIELDS = {**StorageConfig.model_fields, **ControllerSettings.model_fields}
_OPTIONAL_FIELDS = frozenset(name for name, info in _ALL_FIELDS.items() if info.default is None)


def _read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The config fields set by ``HICACHE_<FIELD>`` variables (:data:`hicache_core.env.CONFIG_VARS`).

    Switches (:data:`hicache_core.env.SWITCHES`) are skipped; any other ``HICACHE_*`` name is
    refused, since it is almost always a typo.
    """
    config_vars = {v.name: v.field for v in env.CONFIG_VARS}
    switches = {v.name for v in env.SWITCHES}
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(
                f"environ must map variable names (str) to values (str), got the name {_short_repr(name)}"
            )
        if not name.startswith(ENV_PREFIX) or name in switches:
            continue
        field = config_vars.get(name)
        if field is None:
            raise ConfigError(
                f"unknown environment variable {name}{env.suggest(name)}; hicache reads the variables "
                "listed in hicache_core.env (README: Environment variables): config fields "
                f"{sorted(config_vars)} and switches {sorted(switches)}"
            )
        if not isinstance(raw, str):
            raise ConfigError(f"{name} must be a string (an environment value), got {type(raw).__name__}")
        if field == "options":
            try:
                value: Any = json.loads(raw)
            except (ValueError, RecursionError) as err:  # JSONDecodeError, or nesting too deep
                raise ConfigError(f"{name} must be a JSON object: {err}") from None
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
            out[field] = value
        elif field in _OPTIONAL_FIELDS and raw.strip().lower() in ("", "none"):
            out[field] = None  # an optional field: empty or `none` leaves it unset
        else:
            out[field] = raw
    return out
