"""Options of the suite: parsing ``--hicache-options`` / ``hicache check --options`` values, and
the path options each test isolates (import-light: the core's registry loads on first use)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["isolate_path_options", "parse_options", "path_option_names"]


def path_option_names(backend_cls: Any) -> tuple[str, ...]:
    """The path options of ``backend_cls.Options``, by type or marker, not by name
    (:func:`hicache_core.plugin.registry.path_options`)."""
    from hicache_core.plugin.registry import path_options

    return tuple(path_options(getattr(backend_cls, "Options", None)))


def isolate_path_options(backend_cls: Any, options: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """``options`` with every path option of ``backend_cls`` left unset (absent or ``None``) set to a
    fresh path ``tmp_path / "hicache-<field>"`` (a ``DirectoryPath`` field's directory is created)."""
    from hicache_core.plugin.registry import with_fresh_paths

    return with_fresh_paths(getattr(backend_cls, "Options", None), options, tmp_path)


def parse_options(raw: str | None) -> dict[str, Any]:
    """Parse a JSON object, or ``@path`` to a ``.json``, ``.toml``, ``.yaml`` or ``.yml`` file.

    ``None`` and the empty string mean "no options" (``{}``). Raises :class:`ValueError` with a
    message saying what to fix.
    """
    if raw is None or not raw.strip():
        return {}
    text = raw.strip()
    source = "the options argument"
    suffix = ".json"
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        source = str(path)
        suffix = path.suffix.lower() or ".json"
        from hicache_core.config import read_small_file

        try:
            text = read_small_file(path).decode("utf-8")
        except (OSError, ValueError) as err:  # also: not a small regular file, not UTF-8
            raise ValueError(
                f"cannot read options file {path}: {getattr(err, 'strerror', None) or err}"
            ) from None
    try:
        if suffix == ".toml":
            try:
                import tomllib as toml
            except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
                import tomli as toml  # type: ignore[no-redef]
            data: Any = toml.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as err:  # three parsers, three error types
        raise ValueError(f"{source} is not valid {suffix[1:].upper()}: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f'{source} must hold an object of backend options (for example \'{{"root": "/tmp/x"}}\'), '
            f"got {type(data).__name__}"
        )
    return data
