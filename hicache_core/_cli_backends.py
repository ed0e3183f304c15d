"""``hicache backends [--json]``: installed backends, their status and capabilities."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._registry import describe_backend, find_backends

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
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hicache backends")
    for col in _COLUMNS:
        table.add_column(col, overflow="fold")
    for row in data:
        cells = []
        for col in _COLUMNS:
            value = row.get(col)
            if isinstance(value, list):
                value = ",".join(value)
            elif isinstance(value, bool):
                value = "yes" if value else "no"
            cells.append("-" if value is None else str(value))
        table.add_row(*cells)
    Console(width=200).print(table)
    if not data:
        print("no backends installed; install one, e.g. `pip install -e plugins/file`")
    return 0
