"""``MooncakeOptions``: the backend's options, with SGLang-compatible names and env loading.

Precedence, highest first: explicit options (config file ``options`` / ``--options``), the JSON
file named by ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, the ``MOONCAKE_*`` environment variables
SGLang reads, then the defaults below. ``load_env=False`` ignores the file and the environment.
A bad value from the file or the environment is the operator's mistake: a ``ConfigError`` naming
the variable and the fix (inside pydantic's ``ValidationError``; the core reports it as such).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from hicache_core.config import read_small_file
from hicache_core.errors import ConfigError

__all__ = [
    "CHECKSUM_ENV",
    "CONFIG_PATH_ENV",
    "ENV_FIELDS",
    "INSTALL_HINT",
    "MooncakeOptions",
    "checksum_enabled",
    "parse_size",
    "resolve_device",
]

CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"

INSTALL_HINT = (
    "install the Mooncake store with `pip install mooncake-transfer-engine-non-cuda` (CPU hosts) or "
    "`pip install mooncake-transfer-engine` (CUDA hosts); it needs the system library libibverbs "
    "(`apt-get install -y libibverbs1`)"
)

# environment variable -> option field (first variable found wins for a field)
ENV_FIELDS: tuple[tuple[str, str], ...] = (
    ("MOONCAKE_MASTER", "master_server_address"),
    ("MOONCAKE_CLIENT", "client_server_address"),
    ("MOONCAKE_LOCAL_HOSTNAME", "local_hostname"),
    ("LOCAL_HOSTNAME", "local_hostname"),
    ("MOONCAKE_TE_META_DATA_SERVER", "metadata_server"),
    ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "global_segment_size"),
    ("SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE", "local_buffer_size"),
    ("MOONCAKE_PROTOCOL", "protocol"),
    ("MOONCAKE_DEVICE", "device_name"),
    ("MOONCAKE_MASTER_METRICS_PORT", "master_metrics_port"),
    ("MOONCAKE_CHECK_SERVER", "check_server"),
    ("MOONCAKE_STANDALONE_STORAGE", "standalone_storage"),
    ("MOONCAKE_ENABLE_SSD_OFFLOAD", "enable_ssd_offload"),
    ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", "ssd_offload_path"),
    ("MOONCAKE_TENANT_ID", "tenant_id"),
    ("MOONCAKE_SETUP_TIMEOUT", "setup_timeout_s"),
    ("MOONCAKE_STORE_CHECKSUM", "checksum"),
)

CHECKSUM_ENV = "MOONCAKE_STORE_CHECKSUM"
# the values Mooncake 0.3.13 reads as on / off (case-insensitive); anything else it treats as off
_CHECKSUM_ON = ("1", "true", "yes", "on")
_CHECKSUM_OFF = ("0", "false", "no", "off")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``"4gb"``, ``"512 MB"``, ``"16MiB"`` (units of 1024)."""
    if isinstance(value, bool):
        raise ValueError(f"a size must be a number of bytes or a string like '4gb', got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"a size must be a number of bytes or a string like '4gb' or '512MB', got {value!r}")


def resolve_device(device_name: str, tp_rank: int) -> str:
    """``MOONCAKE_DEVICE`` may be a JSON object keyed by TP rank (SGLang); pick this rank's entry."""
    text = device_name.strip()
    if text.startswith("{"):
        try:
            table = json.loads(text)
        except json.JSONDecodeError:
            return device_name
        if isinstance(table, dict):
            return str(table.get(str(tp_rank), ""))
    return device_name


def _check_protocol(value: str) -> str:
    if value not in ("tcp", "rdma"):
        raise ValueError(f"protocol must be 'tcp' or 'rdma', got {value!r}")
    return value


def checksum_enabled(value: str | None) -> bool:
    """Whether Mooncake enables object checksums for this ``MOONCAKE_STORE_CHECKSUM`` value."""
    return value is not None and value.strip().lower() in _CHECKSUM_ON


def _check_checksum(value: str) -> str:
    if value.strip().lower() not in _CHECKSUM_ON + _CHECKSUM_OFF:
        raise ValueError(
            f"expected one of {'/'.join(_CHECKSUM_ON)} or {'/'.join(_CHECKSUM_OFF)}, got {value!r}"
        )
    return value.strip()


def _check_hostport(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected 'host:port', got {value!r}")
    return value


_ENV_CHECKS = {
    "master_server_address": _check_hostport,
    "client_server_address": _check_hostport,
    "protocol": _check_protocol,
    "global_segment_size": parse_size,
    "local_buffer_size": parse_size,
    "checksum": _check_checksum,
}


def _from_env(
    environ: Mapping[str, str], explicit: Collection[str] = ()
) -> tuple[dict[str, Any], dict[str, str]]:
    """Options from the environment and the SGLang config file, and where each came from (the
    variables of ``explicit`` fields are not read). A bad value is the operator's mistake: a
    :class:`ConfigError` naming the variable and the fix."""
    out: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for var, field in ENV_FIELDS:
        if field not in out and field not in explicit and environ.get(var, "") != "":
            check = _ENV_CHECKS.get(field)
            if check is not None:
                try:
                    check(environ[var])
                except ValueError as err:
                    raise ConfigError(
                        f"environment variable {var}: {err}; {_FIX_VAR.format(var=var)}"
                    ) from None
            out[field] = environ[var]
            sources[field] = f"environment variable {var}"
    path = environ.get(CONFIG_PATH_ENV, "")
    if path:
        try:  # a small regular file: never blocks on a FIFO, never reads /dev/zero without end
            data = json.loads(read_small_file(path).decode("utf-8"))
        except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ConfigError(
                f"{CONFIG_PATH_ENV}={path!r} is not a readable JSON file: {err}; {_FIX_FILE}"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{CONFIG_PATH_ENV}={path!r} must hold a JSON object; {_FIX_FILE}")
        out.update(data)
        sources.update(dict.fromkeys(map(str, data), f"{CONFIG_PATH_ENV}={path!r}"))
    return out, sources


_FIX_VAR = "set {var} to a valid value or unset it (or pass the option explicitly)"
_FIX_FILE = (
    f"point {CONFIG_PATH_ENV} at a regular file (at most 4 MiB) holding a JSON object of mooncake "
    "options, or unset it"
)


def _blame(
    err: ValidationError, sources: Mapping[str, str], explicit: Mapping[str, Any]
) -> ConfigError | None:
    """The environment variable or config file behind the first field error, if one set it."""
    for detail in err.errors():
        field = str(detail["loc"][0]) if detail["loc"] else ""
        if field in sources and field not in explicit:
            source = sources[field]
            what = (
                f"sets {field!r}, which is not a mooncake option"
                if detail["type"] == "extra_forbidden"
                else f"sets option {field!r} to a bad value: {detail['msg']}"
            )
            fix = _FIX_FILE if source.startswith(CONFIG_PATH_ENV) else _FIX_VAR.format(var=source.split()[-1])
            return ConfigError(f"{source} {what}; {fix}")
    return None


class MooncakeOptions(BaseModel):
    """Options of the ``mooncake`` backend (names follow SGLang's ``MooncakeStoreConfig``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    master_server_address: str = Field(
        "127.0.0.1:50051", description="host:port of mooncake_master's RPC service (MOONCAKE_MASTER)"
    )
    metadata_server: str = Field(
        "P2PHANDSHAKE",
        description="transfer-engine metadata: 'P2PHANDSHAKE' or the master's "
        "'http://host:port/metadata' (required when a mooncake_client shares the cluster)",
    )
    protocol: str = Field("tcp", description="transfer protocol: 'tcp' or 'rdma'")
    device_name: str = Field("", description="RDMA device(s); may be a JSON object keyed by TP rank")
    local_hostname: str = Field("localhost", description="address this client advertises to peers")
    global_segment_size: int = Field(
        4 << 30, ge=0, description="bytes this process contributes to the pool (divided by tp*pp)"
    )
    local_buffer_size: int = Field(16 << 20, ge=0, description="transfer-engine local buffer bytes")
    standalone_storage: bool = Field(
        False, description="attach as a dummy client to a separate mooncake_client (setup_dummy)"
    )
    client_server_address: str | None = Field(
        None, description="host:port of the mooncake_client for standalone_storage (MOONCAKE_CLIENT)"
    )
    master_metrics_port: int = Field(9003, ge=1, le=65535, description="master admin/metrics port")
    check_server: bool = Field(False, description="wait for the master's /health before setup")
    enable_ssd_offload: bool = False
    ssd_offload_path: str | None = None
    tenant_id: str = "default"
    mem_pool_size: int = Field(
        0,
        ge=0,
        description=(
            "standalone: size announced to setup_dummy when no pool is allocated through the store "
            "(pool allocation announces standalone_required_bytes instead; 0: the local buffer size)"
        ),
    )
    setup_timeout_s: float = Field(
        5.0, gt=0, le=600, description="bound on reaching the master / client and on setup"
    )
    probe_timeout_s: float = Field(
        0.5, gt=0, le=30, description="TCP probe bound while the master or client is unreachable"
    )
    health_probe_interval_s: float = Field(
        1.0, ge=0, le=60, description="background TCP probe period of the master / client (0: off)"
    )
    max_keys_per_call: int = Field(
        2048, ge=1, le=2048, description="keys per store call (TCP lanes reject larger batches)"
    )
    replica_num: int = Field(1, ge=1, le=16)
    overwrite: bool = Field(
        False,
        description="SET replaces existing objects (upsert); by default an existing key is kept "
        "(pages are content-addressed) and reported stored",
    )
    staging_buffer_size: int = Field(
        32 << 20, ge=1 << 20, description="registered bounce buffer for views outside registered memory"
    )
    reuse_connection: bool = Field(
        True,
        description="stores of one process with the same connection options share one Mooncake "
        "client; an idle one closes at exit or with hicache_mooncake.close_idle_connections()",
    )
    checksum: bool = Field(
        False,
        description="embedded mode: have Mooncake CRC-64 every object (sets MOONCAKE_STORE_CHECKSUM=1 "
        "before the process's first client; process-wide) so a corrupt object is a counted, removed "
        "miss; off by default: measured ~0.37 GB/s per direction with it, 4-20x slower than without. "
        "Standalone: the mooncake_client's own MOONCAKE_STORE_CHECKSUM decides",
    )
    load_env: bool = Field(True, description="read MOONCAKE_* variables and the SGLang config file")

    @field_validator(
        "global_segment_size", "local_buffer_size", "mem_pool_size", "staging_buffer_size", mode="before"
    )
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value)

    @field_validator("master_server_address", "client_server_address")
    @classmethod
    def _hostport(cls, value: str | None) -> str | None:
        return None if value is None else _check_hostport(value)

    @field_validator("protocol")
    @classmethod
    def _protocol(cls, value: str) -> str:
        return _check_protocol(value)

    @model_validator(mode="wrap")
    @classmethod
    def _env(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if not isinstance(data, Mapping):
            return handler(data)
        if not data.get("load_env", True) or str(data.get("load_env")).lower() in ("false", "0"):
            return handler(data)
        env, sources = _from_env(os.environ, explicit=data.keys())
        try:
            return handler({**env, **data})
        except ValidationError as err:  # a value from the environment is the operator's to fix
            blamed = _blame(err, sources, data)
            if blamed is None:
                raise
            raise blamed from None

    @model_validator(mode="after")
    def _check(self) -> MooncakeOptions:
        if self.standalone_storage and not self.client_server_address:
            raise ValueError(
                "standalone_storage=True needs client_server_address ('host:port' of the "
                "mooncake_client; or set MOONCAKE_CLIENT)"
            )
        return self
