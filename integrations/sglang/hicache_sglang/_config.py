"""Translate SGLang's ``HiCacheStorageConfig`` (and its extra config) into a hicache ``StorageConfig``.

SGLang hands a ``dynamic`` backend one flat ``extra_config`` dict shared by SGLang itself, its
dynamic loader and the backend. hicache reads only these keys from it:

``hicache_backend`` (required)
    The hicache backend name (an entry point in ``hicache.backends``, e.g. ``"file"``).
``hicache_options`` (optional, a mapping)
    The backend's options, validated by the backend's ``Options`` model.
``hicache_extensions`` (optional, a list or a comma-separated string)
    hicache extensions to enable (``"metrics"`` is added when SGLang enables storage metrics).
``hicache_kv_dtype`` (optional, a string)
    The KV dtype that namespaces the keys; by default the KV host pool's ``dtype``. Required
    when that dtype is ``uint8`` (SGLang's storage of every fp8/fp4 format): set it to SGLang's
    ``--kv-cache-dtype``, so ``fp8_e4m3`` and ``fp8_e5m2`` servers never share keys.
``hicache_model_revision`` (optional, a string)
    The model's weights revision or fingerprint (e.g. the ``--revision`` SGLang was started with,
    or a commit hash of the checkpoint); when set it separates the key namespace, so two
    checkpoints served under one model name never share pages. SGLang 0.5.23 does not hand its
    ``--revision`` to storage backends (``HiCacheStorageConfig`` has no such field), so the
    adapter reads it from here; a ``revision`` / ``model_revision`` attribute of SGLang's storage
    config is used when a later SGLang version provides one.

Every value is checked when the adapter is built: a wrong type (``"hicache_options": []``, ``""``,
``0`` or ``false``, a non-string key) raises :class:`hicache_core.ConfigError` naming the key;
``null`` means "not given". Any other ``hicache_*`` key is refused (it is almost always a typo),
except SGLang's own ``hicache_storage_pass_prefix_keys``. Keys without the prefix belong to
SGLang and are ignored.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache_core import ConfigError, Layout, StorageConfig
from hicache_core.config import MAX_MODEL_REVISION_LEN

__all__ = [
    "ADAPTER_KEYS",
    "PAGE_CONTIGUOUS_LAYOUTS",
    "AdapterSettings",
    "parse_extra_config",
    "storage_config",
]

ADAPTER_KEYS = (
    "hicache_backend",
    "hicache_options",
    "hicache_extensions",
    "hicache_kv_dtype",
    "hicache_model_revision",
)
# hicache_* keys that belong to SGLang itself and reach the backend untouched.
SGLANG_HICACHE_KEYS = frozenset({"hicache_storage_pass_prefix_keys"})
# SGLang host layouts whose pages are one contiguous run per component (hicache "page_first").
PAGE_CONTIGUOUS_LAYOUTS = frozenset({"page_first", "page_first_direct", "page_head"})


@dataclass(frozen=True)
class AdapterSettings:
    """The hicache part of SGLang's extra config."""

    backend: str
    options: dict[str, Any] = field(default_factory=dict)
    extensions: tuple[str, ...] = ()
    kv_dtype: str | None = None
    model_revision: str | None = None


def parse_extra_config(extra_config: Mapping[str, Any] | None) -> AdapterSettings:
    """Read the ``hicache_*`` keys of SGLang's extra config (see the module docstring)."""
    if extra_config is None:
        extra_config = {}
    if not isinstance(extra_config, Mapping):
        raise ConfigError(
            f"hicache-sglang: the extra config must be a JSON object, got {type(extra_config).__name__}"
        )
    bad_keys = [k for k in extra_config if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(
            f"hicache-sglang: extra-config keys must be strings, got the key {bad_keys[0]!r:.80} "
            f"({type(bad_keys[0]).__name__})"
        )
    extra = dict(extra_config)
    unknown = sorted(
        k
        for k in extra
        if k.startswith("hicache_") and k not in ADAPTER_KEYS and k not in SGLANG_HICACHE_KEYS
    )
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, ADAPTER_KEYS, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"hicache-sglang: unknown extra-config key(s) {', '.join(hints)}; the adapter reads "
            f"{list(ADAPTER_KEYS)}"
        )
    backend = extra.get("hicache_backend")
    if not isinstance(backend, str) or not backend.strip():
        raise ConfigError(
            "hicache-sglang: the extra config must name a hicache backend, e.g. "
            '{"backend_name": "hicache", "module_path": "hicache_sglang", "class_name": '
            '"HiCacheAdapter", "hicache_backend": "file", "hicache_options": {"root": "/var/cache/hicache"}} '
            "(list the installed backends with `hicache backends`)"
        )
    options = extra.get("hicache_options")
    if options is None:
        options = {}
    elif not isinstance(options, Mapping):  # [], "", 0 and false too: never the default root
        raise ConfigError(
            "hicache-sglang: 'hicache_options' must be a JSON object of the backend's options, e.g. "
            f'{{"root": "/var/cache/hicache"}}, got {type(options).__name__} {options!r:.80}'
        )
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"hicache-sglang: 'hicache_options' keys must be strings, got {bad[0]!r:.80}")
    raw_ext = extra.get("hicache_extensions")
    if raw_ext is None:
        extensions: tuple[str, ...] = ()
    elif isinstance(raw_ext, str):
        extensions = tuple(e.strip() for e in raw_ext.split(",") if e.strip())
    elif isinstance(raw_ext, (list, tuple)) and all(isinstance(e, str) for e in raw_ext):
        extensions = tuple(raw_ext)
    else:
        raise ConfigError(
            "hicache-sglang: 'hicache_extensions' must be a list of names or a comma-separated string, "
            f"got {type(raw_ext).__name__} {raw_ext!r:.80}"
        )
    kv_dtype = extra.get("hicache_kv_dtype")
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or not kv_dtype):
        raise ConfigError(
            "hicache-sglang: 'hicache_kv_dtype' must be a non-empty string such as 'bfloat16', "
            f"got {kv_dtype!r:.80}"
        )
    revision = extra.get("hicache_model_revision")
    if revision is not None and (
        not isinstance(revision, str) or not revision.strip() or len(revision) > MAX_MODEL_REVISION_LEN
    ):
        raise ConfigError(
            "hicache-sglang: 'hicache_model_revision' must be a non-empty string of at most "
            f"{MAX_MODEL_REVISION_LEN} characters (a weights revision or commit hash), got {revision!r:.80}"
        )
    return AdapterSettings(backend.strip(), dict(options), extensions, kv_dtype, revision)


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; strings pass through."""
    text = str(dtype)
    return text[len("torch.") :] if text.startswith("torch.") else text


def model_identity(sglang_config: Any, sglang_layout: str) -> str:
    """The model identity that namespaces keys: SGLang's model name plus the page byte format.

    SGLang's page bytes are token-major inside a page for the page-first layouts, and each
    SGLang layout orders a page differently, so the layout is part of the identity; pages of
    another engine or another layout never share keys with these.
    """
    name = getattr(sglang_config, "model_name", None) or "default"
    return f"{name}@sglang:{sglang_layout}"


def model_revision(sglang_config: Any, settings: AdapterSettings) -> str | None:
    """The weights revision that separates the key namespace: ``hicache_model_revision`` from the
    extra config, else what SGLang's storage config carries (no SGLang version up to 0.5.23 has
    one: its ``HiCacheStorageConfig`` holds the model path but not ``--revision``), else None."""
    if settings.model_revision is not None:
        return settings.model_revision
    for attr in ("model_revision", "revision"):
        value = getattr(sglang_config, attr, None)
        if isinstance(value, str) and value.strip():
            return value
    return None


def storage_config(
    sglang_config: Any,
    settings: AdapterSettings,
    *,
    sglang_layout: str,
    kv_dtype: str,
) -> StorageConfig:
    """Build the hicache ``StorageConfig`` for one SGLang rank.

    ``sglang_layout`` is the host pool's layout name (``page_first``, ``layer_first``...).
    Raises :class:`hicache_core.ConfigError` with the field path for invalid values.
    """
    dcp_size = int(getattr(sglang_config, "dcp_size", 1) or 1)
    if dcp_size > 1:
        raise ConfigError(
            f"hicache-sglang: decode context parallelism (dcp_size={dcp_size}) is not supported yet; "
            "run without DCP or use one of SGLang's built-in storage backends"
        )
    layout = Layout.PAGE_FIRST if sglang_layout in PAGE_CONTIGUOUS_LAYOUTS else Layout.LAYER_FIRST
    data: dict[str, Any] = {
        "backend": settings.backend,
        "options": settings.options,
        "model_name": model_identity(sglang_config, sglang_layout),
        "model_revision": model_revision(sglang_config, settings),
        "kv_dtype": kv_dtype,
        "tp_rank": sglang_config.tp_rank,
        "tp_size": sglang_config.tp_size,
        "pp_rank": getattr(sglang_config, "pp_rank", 0),
        "pp_size": getattr(sglang_config, "pp_size", 1),
        "attn_cp_rank": getattr(sglang_config, "attn_cp_rank", 0),
        "attn_cp_size": getattr(sglang_config, "attn_cp_size", 1),
        "is_mla_model": bool(sglang_config.is_mla_model),
        "layout": layout,
        "should_split_heads": bool(getattr(sglang_config, "should_split_heads", False)),
        "extensions": list(settings.extensions),
        "enable_storage_metrics": bool(getattr(sglang_config, "enable_storage_metrics", False)),
    }
    try:
        return StorageConfig.model_validate(data)
    except Exception as err:  # pydantic ValidationError: keep the field paths in the message
        raise ConfigError(f"hicache-sglang: cannot translate SGLang's storage config: {err}") from None


def config_kv_dtype(sglang_config: Any, settings: AdapterSettings) -> str | None:
    """The KV dtype from the extra config, or from SGLang's config when the version has one."""
    if settings.kv_dtype:
        return settings.kv_dtype
    for attr in ("kv_cache_dtype", "kv_dtype"):
        value = getattr(sglang_config, attr, None)
        if value not in (None, "", "auto"):
            return dtype_name(value)
    return None
