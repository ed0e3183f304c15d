"""Backend and extension discovery through entry points.

Listing reads entry-point metadata only; a backend's module is imported when that backend is
selected (or when its capabilities are described). Operators restrict what may load with
``HICACHE_BACKENDS_ALLOW`` / ``HICACHE_BACKENDS_BLOCK`` (comma-separated names).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ..errors import BackendContractError, BackendNotFoundError, BackendUnavailableError
from ..types import Capabilities

__all__ = [
    "BACKENDS_GROUP",
    "EXTENSIONS_GROUP",
    "PluginInfo",
    "backend_names",
    "clear_caches",
    "describe_backend",
    "find_backends",
    "find_extensions",
    "load_backend_class",
    "load_extension_class",
    "validate_backend_class",
]

BACKENDS_GROUP = "hicache.backends"
EXTENSIONS_GROUP = "hicache.extensions"
ALLOW_ENV = "HICACHE_BACKENDS_ALLOW"
BLOCK_ENV = "HICACHE_BACKENDS_BLOCK"

_HOOK_PREFIX = "hicache_"
_IMPL_ATTR = "hicache_impl"  # set by pluggy's HookimplMarker("hicache")


@dataclass(frozen=True)
class PluginInfo:
    """Entry-point metadata of one backend or extension (no import needed)."""

    name: str
    value: str
    group: str
    distribution: str
    version: str

    @property
    def origin(self) -> str:
        return f"{self.name} = {self.value!r} in distribution {self.distribution} {self.version}"


def _names_from_env(var: str, environ: Mapping[str, str]) -> set[str] | None:
    raw = environ.get(var)
    if raw is None or not raw.strip():
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


_scans: dict[tuple[str, tuple[str, ...]], dict[str, list[PluginInfo]]] = {}


def clear_caches() -> None:
    """Forget scanned entry points and loaded classes (after installing plugins in-process)."""
    with _cache_lock:
        _scans.clear()
        _cache.clear()


def _scan(group: str) -> dict[str, list[PluginInfo]]:
    # Scanning every distribution's metadata costs milliseconds; memoise per sys.path.
    key = (group, tuple(sys.path))
    cached = _scans.get(key)
    if cached is None:
        cached = _scans[key] = _scan_uncached(group)
    return cached


def _scan_uncached(group: str) -> dict[str, list[PluginInfo]]:
    found: dict[str, list[PluginInfo]] = {}
    seen: set[tuple[str, str]] = set()
    for ep in entry_points(group=group):
        if (ep.name, ep.value) in seen:
            continue  # the same distribution visible twice on sys.path
        seen.add((ep.name, ep.value))
        dist = getattr(ep, "dist", None)
        info = PluginInfo(
            name=ep.name,
            value=ep.value,
            group=group,
            distribution=dist.name if dist is not None else "<unknown>",
            version=dist.version if dist is not None else "?",
        )
        found.setdefault(ep.name, []).append(info)
    return found


def _filtered(group: str, environ: Mapping[str, str] | None) -> tuple[dict[str, list[PluginInfo]], set[str]]:
    env = os.environ if environ is None else environ
    found = _scan(group)
    hidden: set[str] = set()
    if group == BACKENDS_GROUP:
        allow, block = _names_from_env(ALLOW_ENV, env), _names_from_env(BLOCK_ENV, env) or set()
        hidden = {n for n in found if (allow is not None and n not in allow) or n in block}
    return {n: v for n, v in found.items() if n not in hidden}, hidden


def find_backends(environ: Mapping[str, str] | None = None) -> dict[str, PluginInfo]:
    """Installed, allowed backends by name (metadata only; nothing is imported)."""
    found, _ = _filtered(BACKENDS_GROUP, environ)
    return {name: infos[0] for name, infos in sorted(found.items())}


def find_extensions() -> dict[str, PluginInfo]:
    """Installed extensions by name (metadata only)."""
    found, _ = _filtered(EXTENSIONS_GROUP, None)
    return {name: infos[0] for name, infos in sorted(found.items())}


def backend_names(environ: Mapping[str, str] | None = None) -> list[str]:
    return list(find_backends(environ))


def _not_found(
    kind: str, name: str, group: str, available: list[str], hidden: set[str]
) -> BackendNotFoundError:
    if name in hidden:
        return BackendNotFoundError(
            f"{kind} {name!r} is installed but disabled by {ALLOW_ENV}/{BLOCK_ENV}; "
            f"remove it from {BLOCK_ENV} (or add it to {ALLOW_ENV}) to use it. "
            f"Enabled {kind}s: {', '.join(available) or '(none)'}."
        )
    import difflib  # only an error path needs it

    close = difflib.get_close_matches(name, available, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return BackendNotFoundError(
        f"no hicache {kind} named {name!r}.{hint} Installed {kind}s: {', '.join(available) or '(none)'}. "
        f"A {kind} is a distribution declaring an entry point in group {group!r}; install one "
        f"(for example `pip install hicache-{name}`) or fix the name in your config."
    )


def _resolve(kind: str, name: str, group: str, environ: Mapping[str, str] | None) -> PluginInfo:
    if not isinstance(name, str) or not name:
        raise BackendNotFoundError(f"{kind} name must be a non-empty string, got {name!r}")
    found, hidden = _filtered(group, environ)
    infos = found.get(name)
    if not infos:
        raise _not_found(kind, name, group, sorted(found), hidden)
    if len({(i.distribution, i.value) for i in infos}) > 1:
        owners = "; ".join(i.origin for i in infos)
        raise BackendContractError(
            f"{kind} name {name!r} is declared by several distributions ({owners}); uninstall one "
            f"or hide it with {BLOCK_ENV}"
        )
    return infos[0]


_cache: dict[tuple[str, str, str], type] = {}
_cache_lock = threading.Lock()


def _import(info: PluginInfo, kind: str) -> Any:
    try:
        return EntryPoint(info.name, info.value, info.group).load()
    except ModuleNotFoundError as err:
        missing = err.name or str(err)
        raise BackendUnavailableError(
            f"{kind} {info.origin} failed to import: module {missing!r} is missing. "
            f"Install it (for example `pip install {missing.split('.')[0]}`) or reinstall "
            f"{info.distribution} with its dependencies (`pip install --force-reinstall {info.distribution}`)."
        ) from err
    except ImportError as err:
        raise BackendUnavailableError(
            f"{kind} {info.origin} failed to import: {err}. Check that its native dependencies are "
            f"installed, then reinstall {info.distribution}."
        ) from err
    except Exception as err:
        raise BackendContractError(
            f"{kind} {info.origin} raised {type(err).__name__} while importing: {err}"
        ) from err


def load_backend_class(name: str, environ: Mapping[str, str] | None = None) -> type:
    """Import, validate and return the backend class for ``name`` (cached)."""
    info = _resolve("backend", name, BACKENDS_GROUP, environ)
    key = (info.name, info.value, info.distribution)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    cls = _import(info, "backend")
    validate_backend_class(cls, origin=info.origin)
    with _cache_lock:
        _cache[key] = cls
    return cls  # type: ignore[no-any-return]


def load_extension_class(name: str) -> type:
    """Import and validate the extension class for ``name``."""
    info = _resolve("extension", name, EXTENSIONS_GROUP, None)
    cls = _import(info, "extension")
    if not inspect.isclass(cls):
        raise BackendContractError(f"extension {info.origin} must be a class, got {type(cls).__name__}")
    _check_hooks(cls, info.origin, required=())
    return cls


def _spec_params() -> dict[str, list[str]]:
    from .. import hookspecs

    out = {}
    for attr in hookspecs.__all__:
        if attr.startswith(_HOOK_PREFIX):
            out[attr] = list(inspect.signature(getattr(hookspecs, attr)).parameters)
    return out


def _check_hooks(cls: type, origin: str, required: tuple[str, ...]) -> list[str]:
    specs = _spec_params()
    impls = []
    for attr in dir(cls):
        if not attr.startswith(_HOOK_PREFIX):
            continue
        fn = getattr(cls, attr)
        if not callable(fn):
            continue
        if attr not in specs:
            import difflib

            close = difflib.get_close_matches(attr, list(specs), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise BackendContractError(
                f"{origin}: method {attr!r} looks like a hook but no hicache hookspec has that name{hint} "
                f"Known hooks: {', '.join(sorted(specs))}."
            )
        if getattr(fn, _IMPL_ATTR, None) is None:
            raise BackendContractError(
                f"{origin}: method {attr!r} is not marked as a hook implementation; "
                f"decorate it with @hicache_core.hookimpl"
            )
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        unknown = [p for p in params if p not in specs[attr]]
        if unknown:
            raise BackendContractError(
                f"{origin}: hook {attr!r} takes argument(s) {unknown} that the hookspec does not "
                f"provide; its arguments are {specs[attr]} (names must match exactly)"
            )
        impls.append(attr)
    missing = [r for r in required if r not in impls]
    if missing:
        raise BackendContractError(
            f"{origin}: missing required hook implementation(s) {missing}; implement them as "
            f"methods decorated with @hicache_core.hookimpl (see CONTRIBUTING.md)"
        )
    return impls


def validate_backend_class(cls: Any, origin: str = "backend") -> None:
    """Refuse a backend class that breaks the contract, naming the plugin and the problem."""
    if not inspect.isclass(cls):
        raise BackendContractError(f"{origin}: the entry point must name a class, got {type(cls).__name__}")
    options = getattr(cls, "Options", None)
    try:
        from pydantic import BaseModel
    except ImportError:  # pragma: no cover
        raise
    if not (inspect.isclass(options) and issubclass(options, BaseModel)):
        raise BackendContractError(
            f"{origin}: class {cls.__name__} must define `Options`, a pydantic BaseModel with "
            "model_config = ConfigDict(extra='forbid')"
        )
    if options.model_config.get("extra") != "forbid":
        raise BackendContractError(
            f"{origin}: {cls.__name__}.Options must forbid unknown fields so typos are caught; "
            "set model_config = ConfigDict(extra='forbid')"
        )
    try:
        options()
    except Exception as err:
        raise BackendContractError(
            f"{origin}: {cls.__name__}.Options() must be constructible with defaults (give every "
            f"field a default): {err}"
        ) from None
    caps = getattr(cls, "capabilities", None)
    if not isinstance(caps, Capabilities):
        raise BackendContractError(
            f"{origin}: class {cls.__name__} must declare `capabilities = hicache_core.Capabilities(...)`, "
            f"got {type(caps).__name__}"
        )
    required = ["hicache_register_pool", "hicache_draft_io_capability"]
    if caps.v1:
        required.append("hicache_batch_io_v1")
    if caps.v2:
        required.append("hicache_batch_io_v2")
    _check_hooks(cls, origin, tuple(required))
    try:
        inspect.signature(cls).bind(object(), object())
    except TypeError:
        raise BackendContractError(
            f"{origin}: {cls.__name__} must be constructible as {cls.__name__}(config, options)"
        ) from None


def availability(cls: type) -> str | None:
    """``None`` when the backend can run here, else the reason (from ``cls.availability()``)."""
    probe = getattr(cls, "availability", None)
    if probe is None:
        return None
    reason = probe()
    return None if reason is None else str(reason)


def describe_backend(name: str, info: PluginInfo | None = None) -> dict[str, Any]:
    """Name, distribution, version, status and capabilities (imports the backend)."""
    info = info or _resolve("backend", name, BACKENDS_GROUP, None)
    row: dict[str, Any] = {
        "name": info.name,
        "distribution": info.distribution,
        "version": info.version,
        "entry_point": info.value,
    }
    try:
        cls = load_backend_class(info.name)
    except (BackendUnavailableError, BackendContractError) as err:
        row.update(status=f"{'unavailable' if isinstance(err, BackendUnavailableError) else 'broken'}: {err}")
        row.update(capabilities=None, draft_io=None)
        return row
    caps: Capabilities = cls.capabilities  # type: ignore[attr-defined]
    reason = availability(cls)
    row["status"] = "ok" if reason is None else f"unavailable: {reason}"
    row["capabilities"] = caps.as_dict()
    row["draft_io"] = caps.draft_io.value
    row.update({k: v for k, v in caps.as_dict().items() if k not in row})
    return row
