"""Backend and extension discovery through entry points.

Listing reads entry-point metadata only; a backend's module is imported when that backend is
selected (or when its capabilities are described). Operators restrict what may load with
``HICACHE_BACKENDS_ALLOW`` / ``HICACHE_BACKENDS_BLOCK``: comma-separated names, matched in any
case, ``*`` meaning every backend; an entry that names no installed backend is logged as a
WARNING (with a "did you mean"), never silently ignored.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import import_module, metadata
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ..errors import (
    BackendContractError,
    BackendNotFoundError,
    BackendUnavailableError,
    ConfigError,
    HiCacheError,
    OptionsError,
)
from ..types import Capabilities
from .paths import LEGACY_PATH_OPTIONS, path_options, with_fresh_paths  # re-exported

__all__ = [
    "BACKENDS_GROUP",
    "EXTENSIONS_GROUP",
    "LEGACY_PATH_OPTIONS",
    "PluginInfo",
    "backend_names",
    "clear_caches",
    "defaults_error",
    "describe_backend",
    "find_backends",
    "find_extensions",
    "load_backend_class",
    "load_extension_class",
    "operator_error",
    "path_options",
    "validate_backend_class",
    "with_fresh_paths",
]

BACKENDS_GROUP = "hicache.backends"
EXTENSIONS_GROUP = "hicache.extensions"
ALLOW_ENV = "HICACHE_BACKENDS_ALLOW"
BLOCK_ENV = "HICACHE_BACKENDS_BLOCK"

log = logging.getLogger("hicache")

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


def _names_from_env(var: str, environ: Mapping[str, str], installed: list[str]) -> set[str] | None:
    """An allow / block list's entries, lower-cased (``*`` is every backend), or None when unset or
    empty; an entry naming no installed backend is logged once as a WARNING with a "did you mean"."""
    raw = environ.get(var)
    if raw is None or not raw.strip():
        return None
    entries = {n.strip().lower() for n in raw.split(",") if n.strip()}
    lowered = sorted(n.lower() for n in installed)
    for entry in sorted(entries - {*lowered, "*"}) or ([] if entries else [""]):
        if (var, entry) not in _warned:
            _warned.add((var, entry))
            import difflib  # only this warning needs it

            close = difflib.get_close_matches(entry, lowered, n=1, cutoff=0.6) if entry else []
            log.warning(
                "hicache: %s entry %r matches no installed backend%s (installed: %s)",
                *(var, entry, f"; did you mean {close[0]!r}?" if close else "", ", ".join(installed)),
            )
    return entries


_warned: set[tuple[str, str]] = set()
_scans: dict[tuple[str, tuple[str, ...]], dict[str, list[PluginInfo]]] = {}


def clear_caches() -> None:
    """Forget scanned entry points and loaded classes (after installing plugins in-process)."""
    with _cache_lock:
        _scans.clear()
        _cache.clear()
        _warned.clear()


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
        allow = _names_from_env(ALLOW_ENV, env, sorted(found))
        allow = {"*"} if allow is None else allow  # unset: all; empty entries (",,"): none
        block = _names_from_env(BLOCK_ENV, env, sorted(found)) or set()
        hidden = {n for n in found if not ({"*", n.lower()} & allow) or {"*", n.lower()} & block}
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


# Backends of this project, by entry-point name: the only names an install hint may quote,
# and only when the user typed exactly that name (a near miss is a typo, never an install).
_PROJECT_DISTRIBUTIONS = {
    **{n: f"hicache-{n}" for n in ("file", "mooncake", "nixl")},
    **dict.fromkeys(("hf3fs", "eic", "simm"), "hicache-hf3fs-stub"),
}


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

    # "FILE", "hicache-file", "hicache_file" name the file backend as its user thinks of it.
    bare = name.lower().removeprefix("hicache-").removeprefix("hicache_")
    close = [n for n in available if n.lower() == bare] or difflib.get_close_matches(
        bare, available, n=1, cutoff=0.6
    )
    installed = f"Installed {kind}s: {', '.join(available) or '(none)'}."
    if close:  # a typo: fixing the name is the answer, never installing a look-alike
        return BackendNotFoundError(
            f"no hicache {kind} named {name!r}. Did you mean {close[0]!r}? {installed} "
            "Fix the name in your config or command line."
        )
    known = _PROJECT_DISTRIBUTIONS.get(name) if group == BACKENDS_GROUP else None
    how = (
        f"the {name!r} backend ships in the distribution {known!r} (`pip install {known}`)"
        if known
        else "install the distribution that provides it (its documentation names it; check who "
        "publishes a package before installing it)"
    )
    article = "An" if kind[0] in "aeiou" else "A"
    return BackendNotFoundError(
        f"no hicache {kind} named {name!r}. {installed} {article} {kind} is a distribution declaring an "
        f"entry point in group {group!r}: {how}, or fix the name in your config."
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
        raise _missing_module(info, kind, err) from err
    except ImportError as err:
        raise BackendUnavailableError(
            f"{kind} {info.origin} failed to import: {err}. Check that its native dependencies are "
            f"installed, then reinstall {info.distribution} the way you installed it."
        ) from err
    except AttributeError as err:
        module, _, attr = info.value.partition(":")
        loaded = sys.modules.get(module.strip())
        if loaded is None or hasattr(loaded, attr.strip().split(".")[0]):  # raised by the module's code
            raise BackendContractError(
                f"{kind} {info.origin} raised AttributeError while importing: {err}"
            ) from err
        raise BackendContractError(
            f"{kind} {info.origin}: module {module.strip()!r} has no attribute {attr.strip()!r}; "
            "fix the entry point's value (`module:Class`) in the distribution's pyproject.toml and "
            "reinstall it"
        ) from err
    except Exception as err:
        raise BackendContractError(
            f"{kind} {info.origin} raised {type(err).__name__} while importing: {err}"
        ) from err


def _missing_module(info: PluginInfo, kind: str, err: ModuleNotFoundError) -> Exception:
    """Why an entry point's import found no module, without ever sending the user to install a
    name they did not type: a typo in the entry point or its ``module.Class`` form is the
    distribution's bug; a module missing from an installed distribution is a version or
    installation problem; a missing dependency is installed by reinstalling the plugin."""
    missing = err.name or str(err)
    module, colon, _ = (part.strip() for part in info.value.partition(":"))
    fix = (
        f"fix the value of entry point {info.name!r} in group {info.group!r} of {info.distribution} "
        "(its pyproject.toml) and reinstall it"
    )
    if missing == module or module.startswith(missing + "."):  # the entry point's own module
        parent, _, last = module.rpartition(".")
        if not colon and parent and _has_attr(parent, last):
            return BackendContractError(
                f"{kind} {info.origin}: the entry point must name the class as 'module:Class' "
                f"(with a colon), not 'module.Class': write {f'{parent}:{last}'!r}; {fix}"
            )
        hint = _module_hint(missing, info.distribution)
        return BackendContractError(
            f"{kind} {info.origin}: the entry point names module {missing!r}, which does not exist"
            f"{hint}; {fix}"
        )
    top = missing.split(".")[0]
    owners = sorted(set(_packages_distributions().get(top, [])))
    if owners:
        return BackendUnavailableError(
            f"{kind} {info.origin} failed to import: module {missing!r} is missing, but package "
            f"{top!r} is installed (distribution {', '.join(owners)}): that version has no such "
            f"module, or the installation is broken. Check that the installed version is one "
            f"{info.distribution} supports (its declared requirements)."
        )
    declared = _declared_requirement(info.distribution, top)
    if declared is not None:
        how = (
            f"{info.distribution} declares it as the requirement {declared!r} but it is not "
            f"installed: reinstall {info.distribution} the way you installed it (for example "
            "`pip install -e <its folder>`), so that pip installs its dependencies"
        )
    else:
        how = (
            f"{info.distribution} does not declare the distribution that provides it (an import "
            "name is not always a distribution name): see the plugin's documentation for what to "
            "install, and report the missing dependency to its authors"
        )
    return BackendUnavailableError(
        f"{kind} {info.origin} failed to import: module {missing!r} is missing; {how}."
    )


def _has_attr(module: str, attr: str) -> bool:
    try:
        return hasattr(import_module(module), attr)
    except Exception:
        return False


def _packages_distributions() -> Mapping[str, list[str]]:
    try:
        return metadata.packages_distributions()
    except Exception:  # pragma: no cover - a broken dist-info somewhere on sys.path
        return {}


def _distribution(name: str) -> Any:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared_requirement(dist_name: str, module: str) -> str | None:
    """The requirement of ``dist_name`` whose project name matches import name ``module``."""
    dist = _distribution(dist_name)
    requires: list[str] = (dist.requires if dist is not None else None) or []
    for req in requires:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        if m and _normalise(m[1]) == _normalise(module):
            return req.split(";")[0].strip()
    return None


def _module_hint(missing: str, dist_name: str) -> str:
    """``"; did you mean 'x'?"`` from the distribution's own modules (or importable ones)."""
    import difflib

    dist = _distribution(dist_name)
    names: set[str] = set()
    for f in (dist.files if dist is not None else None) or []:
        parts = f.parts
        if parts and not parts[0].endswith((".dist-info", ".egg-info", "..")) and parts[0] != "__pycache__":
            stem = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
            if f.suffix == ".py" and not stem.startswith("__editable__"):
                names.add(stem)
    top = (dist.read_text("top_level.txt") if dist is not None else None) or ""
    names.update(n.strip() for n in top.splitlines() if n.strip())
    if not names:
        import pkgutil

        names = {m.name for m in pkgutil.iter_modules()}
    close = difflib.get_close_matches(missing, sorted(names), n=1, cutoff=0.6)
    where = f" in {dist_name}" if dist is not None and dist.files else ""
    return f" (did you mean {close[0]!r}{where}?)" if close else ""


def load_backend_class(name: str, environ: Mapping[str, str] | None = None, *, validate: bool = True) -> type:
    """Import, validate and return the backend class for ``name`` (cached).

    ``validate=False`` returns what the entry point names without checking the contract (the
    conformance suite uses it to report a defect as the failing test that names it).
    """
    info = _resolve("backend", name, BACKENDS_GROUP, environ)
    if not validate:
        return _import(info, "backend")  # type: ignore[no-any-return]
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
    if inspect.ismodule(cls):
        found = [n for n, v in vars(cls).items() if inspect.isclass(v) and hasattr(v, "capabilities")]
        hint = f"; for example {cls.__name__}:{found[0]}" if found else ""
        raise BackendContractError(
            f"{origin}: the entry point names module {cls.__name__!r}, not a class; its value must "
            f"be 'module:Class'{hint}"
        )
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
        if operator_error(err) is None:  # else the class is sound: the operator's settings are not
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


def operator_error(err: BaseException) -> HiCacheError | None:
    """The operator's mistake behind a failure of ``Options(...)``, else ``None``: an
    :class:`OptionsError` / :class:`ConfigError` that a validator raised (e.g. from an environment
    variable or a config file the options read), itself or inside pydantic's ValidationError."""
    from pydantic import ValidationError

    if isinstance(err, (OptionsError, ConfigError)):
        return err
    for detail in err.errors() if isinstance(err, ValidationError) else ():
        cause = (detail.get("ctx") or {}).get("error")
        if isinstance(cause, (OptionsError, ConfigError)):
            return cause
    return None


def defaults_error(cls: type) -> HiCacheError | None:
    """Why ``cls.Options()`` fails here because of the operator's settings, else ``None``."""
    try:
        cls.Options()  # type: ignore[attr-defined]
    except Exception as err:
        return operator_error(err)
    return None


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
    misconfigured = defaults_error(cls) if reason is None else None
    row["status"] = "ok" if reason is None else f"unavailable: {reason}"
    if misconfigured is not None:  # installed and sound; the environment it reads is not
        row["status"] = f"misconfigured: {misconfigured}"
    row["capabilities"] = caps.as_dict()
    row["draft_io"] = caps.draft_io.value
    row.update({k: v for k, v in caps.as_dict().items() if k not in row})
    return row
