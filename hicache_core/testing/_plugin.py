"""The ``hicache`` pytest plugin (entry point ``pytest11: hicache``).

Adds ``--hicache-backend NAME`` and ``--hicache-options JSON|@file`` so that::

    python -m pytest --pyargs hicache_core.testing --hicache-backend NAME

runs the conformance suite (``hicache_core/testing/test_installed_backend.py``) against any
installed backend. Without ``--hicache-backend`` that module is never collected, so the plugin
does nothing in other projects' test runs. Loading the plugin imports neither torch nor the
suite: the backend is resolved only when ``--hicache-backend`` is given.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path
from typing import Any

import pytest

from ._options import parse_options

__all__ = ["OPTIONS_KEY", "SUITE_MODULE"]

SUITE_MODULE = Path(__file__).resolve().with_name("test_installed_backend.py")
"""The suite module run by ``--pyargs hicache_core.testing --hicache-backend NAME``."""

OPTIONS_KEY = pytest.StashKey[dict[str, Any]]()
"""``config.stash[OPTIONS_KEY]``: the parsed ``--hicache-options`` (``{}`` when not given)."""

_SUITE_MODULES = (
    "_base",
    "_canary",
    "_keyprops",
    "_t_concurrency",
    "_t_keys",
    "_context",
    "_suite",
    "_t_io",
    "_t_lifecycle",
    "_t_semantics",
    "_t_static",
    "_t_stateful",
    "_t_batch",
    "_t_stores",
    "_t_guard",
)
# Detailed assertion messages in the suite, however hicache-core is installed (not yet imported here).
pytest.register_assert_rewrite(
    *(f"{__package__}.{m}" for m in _SUITE_MODULES if f"{__package__}.{m}" not in sys.modules)
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hicache", "hicache backend conformance suite")
    group.addoption(
        "--hicache-backend",
        action="store",
        default=None,
        metavar="NAME",
        help="run the hicache conformance suite (--pyargs hicache_core.testing) against this backend",
    )
    group.addoption(
        "--hicache-options",
        action="store",
        default=None,
        metavar="JSON|@FILE",
        help="backend options for --hicache-backend: a JSON object or @path to a JSON/TOML/YAML file",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "hicache_rule(*ids): the backend-contract rules a conformance test checks (R1, R2, ...)"
    )
    backend = config.getoption("hicache_backend", None)
    raw = config.getoption("hicache_options", None)
    if raw is not None and not backend:
        raise pytest.UsageError("--hicache-options needs --hicache-backend NAME")
    try:
        config.stash[OPTIONS_KEY] = parse_options(raw)
    except ValueError as err:
        raise pytest.UsageError(f"--hicache-options: {err}") from None
    if backend:
        _check_backend(str(backend), config.stash[OPTIONS_KEY])


def _check_backend(name: str, options: dict[str, Any]) -> None:
    """Fail the session early, with the core's message, when the backend cannot be used: an
    unknown name, a backend that cannot run here, options its model refuses. A class that breaks
    the contract is not refused here: the suite runs and reports the defect as failing tests."""
    from hicache_core.errors import BackendContractError, HiCacheError
    from hicache_core.plugin import availability, load_backend_class

    try:
        try:
            cls = load_backend_class(name)
        except BackendContractError:
            return  # reported by the suite's tests, by name
        reason = availability(cls)
        if reason is not None:
            raise pytest.UsageError(f"--hicache-backend: backend {name!r} cannot run here: {reason}")
        from hicache_core.plugin import validate_options

        validate_options(cls, name, options)
    except HiCacheError as err:
        raise pytest.UsageError(f"--hicache-backend: {err}") from None


def _is_suite(path: Path) -> bool:
    try:
        return path.resolve() == SUITE_MODULE
    except OSError:  # pragma: no cover
        return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if _is_suite(collection_path) and not config.getoption("hicache_backend", None):
        return True  # the installed-backend suite runs only when a backend is named
    return None


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    # Collect the suite even when a project's `python_files` would not match its name.
    if not _is_suite(file_path) or not parent.config.getoption("hicache_backend", None):
        return None
    if parent.session.isinitpath(file_path):
        return None  # named on the command line: the regular python collector takes it
    patterns = parent.config.getini("python_files")
    if any(fnmatch.fnmatch(file_path.name, p) for p in patterns):
        return None  # the regular python collector takes it
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each conformance test's rule ids become a JUnit XML property (``hicache_rules``)."""
    from ._rules import rules_of

    for item in items:
        ids = rules_of(item)
        if ids:
            item.user_properties.append(("hicache_rules", " ".join(ids)))


def pytest_report_header(config: pytest.Config) -> str | None:
    backend = config.getoption("hicache_backend", None)
    if not backend:
        return None
    options = config.stash.get(OPTIONS_KEY, {})
    return f"hicache conformance: backend={backend!r} options={options!r}"
