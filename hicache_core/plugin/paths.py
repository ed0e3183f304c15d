"""Path options of a backend's ``Options`` model: which fields hold a filesystem path, and
fresh temporary paths for those left unset (the conformance suite, ``hicache bench``)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["LEGACY_PATH_OPTIONS", "path_options", "with_fresh_paths"]

LEGACY_PATH_OPTIONS = ("root", "file_path_prefix")
"""``str`` option names treated as paths for backends written before path options were typed."""

_PATH_FORMATS = {"path": "path", "directory-path": "dir"}


def path_options(options_model: Any) -> dict[str, str]:
    """The fields of a backend's ``Options`` model that hold a filesystem path, with their kind.

    A field is a path option when its type is a path (``pathlib.Path``, ``Path | None``,
    pydantic's ``NewPath`` or ``DirectoryPath``, any ``os.PathLike``) or when it is marked as one
    with ``Field(json_schema_extra={"format": "path"})`` (``"directory-path"`` for a directory
    that must exist); the ``str`` fields named in :data:`LEGACY_PATH_OPTIONS` count too. The kind
    is ``"dir"`` when the path must be an existing directory, else ``"path"`` (nothing needs to
    exist there). ``FilePath`` fields (an existing file) are not path options: no fresh path
    can satisfy them. The conformance suite and ``hicache bench`` give each path option the user
    did not set a fresh temporary path, and remove it afterwards.
    """
    fields = getattr(options_model, "model_fields", None) or {}
    out: dict[str, str] = {}
    for name, field in fields.items():
        extra = getattr(field, "json_schema_extra", None)
        marked = extra.get("format") if isinstance(extra, Mapping) else None
        kind = _PATH_FORMATS.get(marked) if isinstance(marked, str) else None
        kind = kind or _path_kind(getattr(field, "annotation", None), getattr(field, "metadata", ()))
        if kind is None and name in LEGACY_PATH_OPTIONS:
            kind = "path"
        if kind in ("path", "dir"):  # an existing-file field (pydantic FilePath) is the user's to give
            out[name] = kind
    return out


def _path_kind(annotation: Any, metadata: Any = ()) -> str | None:
    """``"path"`` / ``"dir"`` / ``"existing"`` (must exist as a regular file) when ``annotation`` (through unions and ``Annotated``)
    is a path type, else ``None``."""
    import typing
    from pathlib import PurePath

    for m in metadata or ():
        kind = getattr(m, "path_type", None)  # pydantic's PathType: 'dir', 'new' or an existing file
        if kind == "dir":
            return "dir"
        if kind == "new":
            return "path"
        if kind is not None:
            return "existing"
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        return _path_kind(base, meta)
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        kinds = [_path_kind(a) for a in typing.get_args(annotation)]
        return next((k for k in kinds if k is not None), None)
    if inspect.isclass(annotation) and (issubclass(annotation, PurePath) or annotation is os.PathLike):
        return "path"
    return None


def with_fresh_paths(
    options_model: Any, options: Mapping[str, Any], base_dir: str | os.PathLike[str]
) -> dict[str, Any]:
    """``options`` with every :func:`path_options` field it leaves unset (absent or ``None``) set
    to ``{base_dir}/hicache-{field}``; a ``"dir"`` field's directory is created, other paths are
    not (the backend creates its directory or files there)."""
    out = dict(options)
    for name, kind in path_options(options_model).items():
        if out.get(name) is None:
            path = os.path.join(os.fspath(base_dir), f"hicache-{name}")
            if kind == "dir":
                os.makedirs(path, exist_ok=True)
            out[name] = path
    return out
