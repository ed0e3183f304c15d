"""The core's layout holds its rules: imports point down the layers, no cycles, no private name
crosses a package, no module over 600 lines (ARCHITECTURE.md lists the layers)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "hicache_core"

# Bottom up; a module may import from its own layer and the ones below (ARCHITECTURE.md).
LAYERS = [
    {"errors", "env"},
    {"types", "native"},
    {"paging", "pools", "config"},
    {"hookspecs", "plugin"},
    {"transfer"},
    {"extensions"},
    {"cli", "bench", "testing", "sizing", "__init__"},
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str:
    """The top-level unit of a core module: ``hicache_core.plugin.store`` -> ``plugin``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) for each import of ``path`` into hicache_core."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("hicache_core"):
                names = [a.name for a in node.names]
                if not node.module and node.level:  # `from . import x`: x is a module
                    out.extend((f"{target}.{n}", [], node.lineno) for n in names)
                else:
                    out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names if a.name.startswith("hicache_core"))
    return out


FILES = sorted(p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts)


def test_imports_point_down_the_layers() -> None:
    bad = []
    for path in FILES:
        me = _unit(_module_name(path))
        for target, _, line in _imports(path):
            other = _unit(target)
            if RANK[other] > RANK[me]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {me} (layer {RANK[me]}) imports {target}")
    assert not bad, "imports must point down (ARCHITECTURE.md):\n" + "\n".join(bad)


def test_no_private_name_crosses_a_package() -> None:
    bad = []
    for path in FILES:
        me = _module_name(path)
        my_package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
        for target, names, line in _imports(path):
            same = target == my_package or target.startswith(my_package + ".")
            private_module = any(p.startswith("_") and p != "__init__" for p in target.split(".")[1:])
            private_names = [n for n in names if n.startswith("_")]
            if not same and (private_module or private_names):
                bad.append(f"{path.relative_to(ROOT)}:{line}: from {target} import {names}")
    assert not bad, "private names cross a package:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    modules = {_module_name(p) for p in FILES}
    for path in FILES:
        me = _module_name(path)
        for target, names, _ in _imports(path):
            # `from pkg import name` may name a submodule: count it as an edge to that module
            hits = {f"{target}.{n}" for n in names} & modules
            for dep in hits or ({target} & modules):
                if dep != me and not me.startswith(dep + ".") and not dep.startswith(me + "."):
                    graph[me].add(dep)
    # A package __init__ importing its own submodules is not a cycle; a submodule importing
    # its package's __init__ from another package is covered by the layer rule.
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("path", FILES + sorted(CORE.rglob("*.c")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_600_lines(path: Path) -> None:
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 600


def test_plugins_use_only_public_core_names() -> None:
    bad = []
    for folder in ("plugins", "integrations"):
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts or ".venv" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                mod = node.module if isinstance(node, ast.ImportFrom) and not node.level else None
                if mod and mod.startswith("hicache_core"):
                    names = [a.name for a in node.names]
                    if any(p.startswith("_") for p in mod.split(".")) or any(
                        n.startswith("_") for n in names
                    ):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {mod} import {names}")
    assert not bad, "\n".join(bad)
