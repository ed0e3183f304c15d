"""``hicache backends [--json]``: installed backends, their status and capabilities."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..plugin import describe_backend, find_backends

__all__ = ["add_arguments", "run"]

_COLUMNS = (
    "name",
    "distribution",
    "version",
    "status",
    "v1",
    "v2",
    "zero_copy",
    "persistent",
    "shared",
    "set_skips_existing",
    "draft_io",
    "pools",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list of objects")


def rows() -> list[dict[str, Any]]:
    return [describe_backend(name, info) for name, info in find_backends().items()]


def run(args: argparse.Namespace) -> int:
    data = rows()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(_table(data))
    if not data:
        print("no backends installed; install one, e.g. `pip install -e plugins/file`")
    return 0


_WRAP = {"status": 48, "pools": 24}  # columns wrapped onto continuation lines


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "-" if value is None else str(value)


def _table(data: list[dict[str, Any]]) -> str:
    """A plain-text table (no rich: listing must start fast; rich's import alone costs ~0.1 s)."""
    import textwrap

    rows = [[c for c in _COLUMNS]]
    for row in data:
        rows.append([_cell(row.get(col)) for col in _COLUMNS])
    cells = [
        [
            textwrap.wrap(v, _WRAP[col], break_on_hyphens=False) or [""] if col in _WRAP else [v]
            for col, v in zip(_COLUMNS, r)
        ]
        for r in rows
    ]
    widths = [max(len(line) for r in cells for line in r[i]) for i in range(len(_COLUMNS))]
    out = []
    for n, r in enumerate(cells):
        for k in range(max(len(c) for c in r)):
            out.append("  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
