"""The hicache backend conformance suite.

* :class:`BackendConformance`: subclass it in your tests (the zarr ``StoreTests`` pattern);
* ``pytest --pyargs hicache_core.testing --hicache-backend NAME [--hicache-options JSON|@file]``
  runs it against any installed backend (the ``hicache`` pytest plugin adds the options);
* ``hicache check NAME [--options JSON|@file] [--rules]`` runs it and prints a summary per group
  (with ``--rules``, per rule of the contract: :data:`RULES`).

Importing this package is cheap: the suite (and torch) load on first use of
:class:`BackendConformance`, so the pytest plugin stays import-light.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._groups import GROUPS, group_of
from ._options import parse_options
from ._rules import RULES, Rule, rule, rules_of

if TYPE_CHECKING:  # pragma: no cover
    from ._context import SuiteContext, default_page_bytes
    from ._docs import hookspec_signatures
    from ._suite import BackendConformance

__all__ = [
    "GROUPS",
    "RULES",
    "BackendConformance",
    "Rule",
    "SuiteContext",
    "default_page_bytes",
    "group_of",
    "hookspec_signatures",
    "parse_options",
    "rule",
    "rules_of",
]

_LAZY = {
    "BackendConformance": "._suite",
    "SuiteContext": "._context",
    "default_page_bytes": "._context",
    "hookspec_signatures": "._docs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_core.testing' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
