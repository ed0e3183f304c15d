"""Grep-able proof that the core decides from declared capabilities, never from backend names.

Every Python string literal in ``hicache_core/`` (docstrings excepted; comments are not code) and
every identifier is scanned with :mod:`ast`. A literal is a *backend name* when, stripped and
lower-cased, it equals one of the backend names, or when it contains one of the distinctive
names (``mooncake``, ``hf3fs``, ``eic``, ``nixl``, ``simm``) as a word; ``file`` counts only as
the whole literal, because it is an ordinary English word in messages. An identifier is flagged
when one of its ``_``-separated words is a distinctive name (``is_mooncake``, ``use_nixl``...).

One table is exempt: ``_PROJECT_DISTRIBUTIONS`` in ``plugin/registry.py`` maps this project's
backend names to their distributions, so that a user who typed exactly one of those names is told
which distribution provides it (an install hint, never a code path).

One use is allowed: the literal ``"file"`` as a *default value* (a parameter default, a class-level
field default, the first argument of ``Field(...)`` or ``default=``), because design §7 makes the file backend the
operator's default. It chooses what an operator gets when they name nothing; it never steers a
code path.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import hicache_core

CORE = Path(hicache_core.__file__).resolve().parent
NAMES = ("file", "mooncake", "hf3fs", "eic", "nixl", "simm")
DISTINCT = NAMES[1:]
WORD = re.compile(r"(?<![a-z0-9])(" + "|".join(DISTINCT) + r")(?![a-z0-9])")
DEFAULT_OK = "file"
HINT_TABLE = "_PROJECT_DISTRIBUTIONS"


@dataclass(frozen=True)
class Finding:
    where: str
    kind: str  # "string", "identifier" or "default"
    text: str


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _default_positions(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out.update(id(d) for d in [*node.args.defaults, *node.args.kw_defaults] if d is not None)
        elif isinstance(node, ast.ClassDef):  # dataclass / pydantic field defaults
            out.update(id(s.value) for s in node.body if isinstance(s, ast.AnnAssign) and s.value is not None)
        elif isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname == "Field" and node.args:
                out.add(id(node.args[0]))
            out.update(id(k.value) for k in node.keywords if k.arg == "default")
    return out


def _identifiers(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    if isinstance(node, ast.alias):
        return [node.name, node.asname or ""]
    return []


def scan(source: str, where: str) -> tuple[list[Finding], int]:
    """``(findings, number of string literals scanned)`` for one module's source."""
    tree = ast.parse(source)
    docs, defaults = _docstrings(tree), _default_positions(tree)
    hints = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == HINT_TABLE for t in node.targets)
        for n in ast.walk(node.value)
    }
    findings: list[Finding] = []
    literals = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs | hints:
            literals += 1
            text = node.value.strip().lower()
            if text in NAMES or WORD.search(node.value.lower()):
                line = f"{where}:{node.lineno}"
                if text == DEFAULT_OK and id(node) in defaults:
                    findings.append(Finding(line, "default", node.value))
                else:
                    findings.append(Finding(line, "string", node.value))
        for ident in _identifiers(node):
            if any(w in DISTINCT for w in re.split(r"[_.]", ident.lower())):
                findings.append(Finding(f"{where}:{getattr(node, 'lineno', '?')}", "identifier", ident))
    return findings, literals


def scan_core() -> tuple[list[Finding], int, int]:
    findings: list[Finding] = []
    files = literals = 0
    for path in sorted(CORE.rglob("*.py")):
        f, n = scan(path.read_text(encoding="utf-8"), str(path.relative_to(CORE.parent)))
        findings += f
        files += 1
        literals += n
    return findings, files, literals


def test_core_contains_no_backend_name_decisions() -> None:
    findings, files, literals = scan_core()
    assert files >= 15 and literals >= 300, (files, literals)  # the scan really covered the core
    bad = [f for f in findings if f.kind != "default"]
    assert bad == [], (
        "backend names in hicache_core (decide from declared capabilities instead):\n"
        + "\n".join(f"  {f.where}: {f.kind} {f.text!r}" for f in bad)
    )
    assert all(f.text == DEFAULT_OK for f in findings)


def test_scanner_flags_name_based_decisions() -> None:
    bad = textwrap.dedent(
        '''
        """Mentions of mooncake in a docstring are fine."""
        from pydantic import Field

        DISPATCH = {"file": 1}

        def attach(store, name):
            """hf3fs and nixl are discussed here, harmlessly."""
            if store.name == "mooncake":  # a comment naming simm is not code
                return 1
            if name in {"hf3fs", "eic", "nixl", "simm"}:
                return 2
            match name:
                case "FILE ":
                    return 3
            is_nixl = name.startswith("nixl")
            return f"{name}-simm" if is_nixl else None

        def _use_eic(backend="mooncake"):
            return Field("file"), "config file not found"

        class Request:
            backend: str = "file"
            other: str = "hf3fs"
        '''
    )
    findings, _ = scan(bad, "bad.py")
    flagged = sorted((f.kind, f.text) for f in findings)
    assert flagged == sorted(
        [
            ("string", "file"),
            ("string", "mooncake"),
            ("string", "hf3fs"),
            ("string", "eic"),
            ("string", "nixl"),
            ("string", "simm"),
            ("string", "FILE "),
            ("string", "nixl"),
            ("string", "-simm"),
            ("identifier", "is_nixl"),
            ("identifier", "is_nixl"),
            ("identifier", "_use_eic"),
            ("string", "mooncake"),  # a default, but only "file" may be one
            ("default", "file"),
            ("default", "file"),
            ("string", "hf3fs"),
        ]
    )


def test_scanner_sees_the_known_default() -> None:
    # StorageConfig.backend defaults to the file backend (design §7); if that moves, keep this
    # test honest by updating it rather than deleting it.
    findings, _, _ = scan_core()
    defaults = [f for f in findings if f.kind == "default"]
    assert any(f.where.startswith("hicache_core/config.py:") for f in defaults), defaults
