"""Parsing ``--hicache-options`` / ``hicache check --options`` values (import-light)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["parse_options"]


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
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"cannot read options file {path}: {err.strerror or err}") from None
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
