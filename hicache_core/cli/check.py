"""``hicache check NAME [--options JSON|@file] [-- extra pytest args]``: certify a backend.

Resolves the backend first (an unknown or unavailable backend is reported with the core's
message, no traceback), validates the options, then runs the conformance suite in-process with
``pytest.main`` (``--pyargs hicache_core.testing --hicache-backend NAME``) and prints a summary
table per test group with the skip reasons. Exit code 0 only when no test failed or errored.
pytest and rich are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailableError, HiCacheError, OptionsError

__all__ = ["GroupSummary", "add_arguments", "run", "summarize"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="backend name (entry point in group hicache.backends)")
    parser.add_argument(
        "--options",
        default=None,
        metavar="JSON|@FILE",
        help="backend options: a JSON object or @path to a JSON/TOML/YAML file "
        "(a 'root' option, when the backend has one, defaults to a fresh temp dir per test)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="hide pytest's progress output")
    parser.epilog = "Arguments after `--` go to pytest, e.g. `hicache check file -- -k v1 -x`."


@dataclass
class GroupSummary:
    """Outcome counts of one test group."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    xfailed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class _Collector:
    """A pytest plugin recording each test's final outcome."""

    def __init__(self) -> None:
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.collect_errors: list[str] = []

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid or '<collection>'}: {_text(report.longrepr)[-400:]}")

    def pytest_runtest_logreport(self, report: Any) -> None:
        nodeid, prev = report.nodeid, self.outcomes.get(report.nodeid)
        if prev is not None and prev[0] in ("failed", "error"):
            return
        wasxfail = getattr(report, "wasxfail", None)
        if report.when == "call":
            if wasxfail is not None:
                self.outcomes[nodeid] = ("xfailed" if report.skipped else "passed", str(wasxfail))
            elif report.skipped:
                self.outcomes[nodeid] = ("skipped", _skip_reason(report.longrepr))
            else:
                self.outcomes[nodeid] = (report.outcome, _crash(report.longrepr) if report.failed else "")
        elif report.skipped:
            self.outcomes[nodeid] = (
                ("xfailed", str(wasxfail))
                if wasxfail is not None
                else ("skipped", _skip_reason(report.longrepr))
            )
        elif report.failed:
            self.outcomes[nodeid] = ("error", f"error in {report.when}: {_crash(report.longrepr)}")


def _text(longrepr: Any) -> str:
    return "" if longrepr is None else str(longrepr)


def _crash(longrepr: Any) -> str:
    """The first line of a failure's exception message, shortened."""
    message = getattr(getattr(longrepr, "reprcrash", None), "message", None) or _text(longrepr)
    first = message.strip().splitlines()[0] if message.strip() else ""
    return first if len(first) <= 160 else first[:157] + "..."


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return _text(longrepr)


def summarize(outcomes: Mapping[str, tuple[str, str]]) -> dict[str, GroupSummary]:
    """Per group (in :data:`GROUPS` order): counts, skip reasons and failing test names."""
    from ..testing import GROUPS, group_of

    groups = {name: GroupSummary() for name in [*GROUPS, "other"]}
    for nodeid, (outcome, detail) in outcomes.items():
        g = groups[group_of(nodeid)]
        test = nodeid.rsplit("::", 1)[-1]
        if outcome == "passed":
            g.passed += 1
        elif outcome == "skipped":
            g.skipped += 1
            g.reasons[detail] = g.reasons.get(detail, 0) + 1
        elif outcome == "xfailed":
            g.xfailed += 1
            g.reasons[f"xfail: {detail}"] = g.reasons.get(f"xfail: {detail}", 0) + 1
        else:
            g.failed += 1
            g.failures.append(f"{test}: {detail}" if detail else test)
    return {k: v for k, v in groups.items() if v.passed or v.failed or v.skipped or v.xfailed or k != "other"}


def _pytest_args(
    name: str, options: dict[str, Any] | None, workdir: Path, extra: list[str], quiet: bool
) -> list[str]:
    import hicache_core.testing as testing

    suite_dir = Path(testing.__file__).resolve().parent
    ini = workdir / "pytest.ini"
    ini.write_text("[pytest]\n")
    args = [
        "--pyargs",
        "hicache_core.testing",
        "--hicache-backend",
        name,
        "-c",
        str(ini),
        "--rootdir",
        str(suite_dir.parent.parent),
        "--confcutdir",
        str(suite_dir),
        "--noconftest",  # the suite needs none; never pick up the current project's conftest.py
        "-p",
        "no:cacheprovider",
        "--tb=short",
        "-q",
        "--basetemp",
        str(workdir / "tmp"),
    ]
    if quiet:
        args += ["--no-summary", "-qq", "--tb=no"]
    if options:
        args += ["--hicache-options", json.dumps(options)]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        args += ["-p", "hicache_core.testing._plugin"]
    return args + extra


def run(args: argparse.Namespace) -> int:
    from ..plugin import availability, load_backend_class, validate_options
    from ..testing import parse_options

    name: str = args.name
    cls = load_backend_class(name)  # BackendNotFoundError lists the installed backends
    reason = availability(cls)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} cannot run here: {reason}")
    try:
        options = parse_options(args.options)
    except ValueError as err:
        raise OptionsError(f"--options: {err}") from None
    validate_options(cls, name, options)

    try:
        import pytest
    except ImportError:
        raise HiCacheError(
            "hicache check runs the conformance suite with pytest, which is not installed; "
            "install it with `pip install 'hicache-core[testing]'`"
        ) from None

    collector = _Collector()
    extra = list(getattr(args, "passthrough", []) or [])
    with tempfile.TemporaryDirectory(prefix="hicache-check-") as tmp:
        code = pytest.main(_pytest_args(name, options, Path(tmp), extra, args.quiet), plugins=[collector])
    summary = summarize(collector.outcomes)
    _print(name, summary, collector.collect_errors)
    failed = sum(g.failed for g in summary.values()) + len(collector.collect_errors)
    if failed:
        return 1
    if int(code) != 0:
        print(f"hicache check: pytest exited with code {int(code)} (no test failed; see its output above)")
        return int(code)
    return 0


def _print(name: str, summary: dict[str, GroupSummary], collect_errors: list[str]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..testing import GROUPS

    table = Table(title=f"hicache check {name}", show_lines=False)
    for col, justify in (("group", "left"), ("passed", "right"), ("failed", "right"), ("skipped", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    table.add_column("notes (skip reasons, failing tests)", overflow="fold")
    totals = GroupSummary()
    for group, g in summary.items():
        notes = [f"FAILED {t}" for t in g.failures]
        notes += [f"{r} (x{n})" if n > 1 else r for r, n in g.reasons.items()]
        if not (g.passed or g.failed or g.skipped or g.xfailed):
            notes = [f"(not run) {GROUPS.get(group, '')}"]
        skipped = f"{g.skipped}" + (f" +{g.xfailed} xfail" if g.xfailed else "")
        style = "red" if g.failed else ("green" if g.passed else "yellow")
        table.add_row(group, str(g.passed), str(g.failed), skipped, escape("\n".join(notes)), style=style)
        totals.passed += g.passed
        totals.failed += g.failed
        totals.skipped += g.skipped
        totals.xfailed += g.xfailed
    table.add_row(
        "total",
        str(totals.passed),
        str(totals.failed),
        f"{totals.skipped}" + (f" +{totals.xfailed} xfail" if totals.xfailed else ""),
        "",
        style="bold",
    )
    console = Console(width=max(120, Console().width))
    console.print(table)
    for err in collect_errors:
        console.print(f"[red]collection error:[/red] {escape(err)}")
    verdict = "[red]FAILED[/red]" if totals.failed or collect_errors else "[green]PASSED[/green]"
    console.print(
        f"backend {name!r}: {verdict} - {totals.passed} passed, {totals.failed} failed, "
        f"{totals.skipped} skipped, {totals.xfailed} xfailed"
    )
