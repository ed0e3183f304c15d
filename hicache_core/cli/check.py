"""``hicache check NAME [--options JSON|@file] [--rules] [--json FILE] [--junitxml FILE] [-- pytest args]``.

Resolves the backend first (an unknown or unavailable backend is reported with the core's
message, no traceback), validates the options, then runs the conformance suite in-process with
``pytest.main`` (``--pyargs hicache_core.testing --hicache-backend NAME``) and prints a summary
table per test group with the skip reasons (``--rules``: also one row per rule of the backend
contract, with its tests and their result). A backend class that breaks the contract (a bad
``Options`` model, a misspelled hook, ...) is not refused here: the suite runs and reports the
defect as failing tests. ``--json FILE`` writes the result as one JSON object (also when the
backend cannot be resolved), ``--junitxml FILE`` pytest's JUnit XML (both checked writable before
the suite runs). Exit code 0 only when pytest exited 0, no test failed or errored and at least one
passed; otherwise the verdict is not PASSED and the line after it says why (pytest's exit code
explained). pytest and rich are imported only when the command runs.

The run leaves nothing behind in the working directory: installed pytest plugins are not
auto-loaded (the suite's own are loaded by name; ``-p NAME`` after ``--`` loads another) and
hypothesis keeps its files in the run's temporary directory. ``--test-timeout S`` fails a test
phase that runs longer than ``S`` seconds (``_timeout.py``); a test the alarm cannot interrupt is
ended by a watchdog that prints the summary of what ran and exits. A temporary directory that
cannot be removed after the run (a backend still writing into its roots after close) is a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BackendContractError, BackendUnavailableError, HiCacheError, OptionsError
from ._check_guard import Watchdog, isolated, plugins_for, remove_workdir, thread_notes

__all__ = [
    "JSON_SCHEMA",
    "GroupSummary",
    "RuleSummary",
    "add_arguments",
    "report",
    "rule_summary",
    "run",
    "summarize",
]

JSON_SCHEMA = "hicache-check/1"
"""The ``schema`` field of ``hicache check --json``: bumped when a field changes meaning."""

DEFAULT_TEST_TIMEOUT_S = 120.0
"""``--test-timeout``: seconds a test phase may run before it fails as "the backend did not answer"."""

CLEANUP_NODE = "hicache check::cleanup"
"""The pseudo-test that fails when the run's temporary directory cannot be removed (group ``other``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="backend name (entry point in group hicache.backends)")
    parser.add_argument(
        "--options",
        default=None,
        metavar="JSON|@FILE",
        help="backend options: a JSON object or @path to a JSON/TOML/YAML file "
        "(every path option left unset gets a fresh temporary path per test)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help=f"write the result as JSON to PATH (schema {JSON_SCHEMA!r}: verdict, totals, groups, tests)",
    )
    parser.add_argument("--junitxml", metavar="PATH", default=None, help="write pytest's JUnit XML report")
    parser.add_argument(
        "--rules",
        action="store_true",
        help="also print one row per rule of the backend contract (R1, R2, ...): its tests and their "
        "result for this backend; a skipped rule shows the capability that skips it",
    )
    parser.add_argument(
        "--test-timeout",
        type=_seconds,
        default=DEFAULT_TEST_TIMEOUT_S,
        metavar="SECONDS",
        help="fail a test whose setup, body or teardown runs longer than SECONDS: the backend did not "
        f"answer (default {DEFAULT_TEST_TIMEOUT_S:g}; 0: no limit)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="hide pytest's progress output")
    parser.epilog = "Arguments after `--` go to pytest, e.g. `hicache check file -- -k v1 -x`."


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit), got {text!r}")
    return value


@dataclass
class GroupSummary:
    """Outcome counts of one test group."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    xfailed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


@dataclass
class RuleSummary:
    """One rule of the contract for one backend: its tests and their combined result."""

    topic: str
    text: str
    tests: list[str] = field(default_factory=list)
    result: str = "not run"
    reasons: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class _Collector:
    """A pytest plugin recording each test's final outcome and the rules it is tagged with."""

    def __init__(self) -> None:
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.collect_errors: list[str] = []
        self.rules: dict[str, tuple[str, ...]] = {}

    def pytest_itemcollected(self, item: Any) -> None:
        from ..testing import rules_of

        self.rules[item.nodeid] = rules_of(item)

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
    """The first line of a failure's exception message (whole: ``--json`` keeps it, the table
    shortens it)."""
    message = getattr(getattr(longrepr, "reprcrash", None), "message", None) or _text(longrepr)
    message = message.removeprefix(_TIMEOUT_PREFIX)
    return message.strip().splitlines()[0] if message.strip() else ""


_TIMEOUT_PREFIX = "hicache_core.cli._timeout.TimeLimitExceeded: "


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def rule_summary(
    outcomes: Mapping[str, tuple[str, str]], rules: Mapping[str, tuple[str, ...]]
) -> dict[str, RuleSummary]:
    """Per rule (in :data:`RULES` order): its tests (by name, parameters folded) and its result:
    ``failed`` when one of its tests failed, else ``passed`` when one passed, else ``xfailed`` or
    ``skipped`` (with the skip reasons, which name the capability), else ``not run``."""
    from ..testing import RULES

    out = {rid: RuleSummary(r.topic, r.text) for rid, r in RULES.items()}
    seen: dict[str, set[str]] = {rid: set() for rid in out}
    for nodeid, ids in rules.items():
        test = nodeid.rsplit("::", 1)[-1]
        outcome, detail = outcomes.get(nodeid, ("not run", ""))
        for rid in ids:
            summary = out.get(rid)
            if summary is None:
                continue
            base = test.split("[", 1)[0]
            if base not in seen[rid]:
                seen[rid].add(base)
                summary.tests.append(base)
            if outcome in ("failed", "error"):
                summary.failures.append(f"{test}: {detail}" if detail else test)
            elif outcome == "skipped":
                summary.reasons[detail] = summary.reasons.get(detail, 0) + 1
            if outcome != "not run":
                seen[rid].add(f"@{outcome}")
    rank = ("failed", "error", "passed", "xfailed", "skipped")
    for rid, summary in out.items():
        got = next((o for o in rank if f"@{o}" in seen[rid]), "not run")
        summary.result = "failed" if got == "error" else got
    return out


def _pytest_args(
    name: str,
    options: dict[str, Any] | None,
    workdir: Path,
    extra: list[str],
    quiet: bool,
    test_timeout: float = 0.0,
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
        "-p",  # plugin auto-loading is off for the run (see isolated): the suite's are loaded by name
        "hicache_core.testing._plugin",
        "-p",
        "hicache_core.cli._timeout",
        "--tb=short",
        "-q",
        "--basetemp",
        str(workdir / "tmp"),
    ]
    if test_timeout > 0:
        args += ["--hicache-test-timeout", f"{test_timeout:g}"]
    if quiet:
        args += ["--no-summary", "-qq", "--tb=no"]
    if options:
        args += ["--hicache-options", json.dumps(options)]
    return args + plugins_for(extra) + extra


def run(args: argparse.Namespace) -> int:
    json_path: str | None = getattr(args, "json", None)
    try:
        return _run(args, json_path)
    except HiCacheError as err:  # resolved before the suite runs: still a machine-readable result
        if json_path:
            _write_json(json_path, {"schema": JSON_SCHEMA, "backend": args.name, "verdict": "error",
                                    "error": f"{type(err).__name__}: {err}", "exit_code": 2})  # fmt: skip
        raise


def _run(args: argparse.Namespace, json_path: str | None) -> int:
    from ..plugin import availability, load_backend_class, validate_options
    from ..testing import parse_options

    name: str = args.name
    contract_error: str | None = None
    try:
        cls = load_backend_class(name)  # BackendNotFoundError lists the installed backends
    except BackendContractError as err:  # the suite reports it, as failing tests that name it
        contract_error = str(err)
    else:
        reason = availability(cls)
        if reason is not None:
            raise BackendUnavailableError(f"backend {name!r} cannot run here: {reason}")
    try:
        options = parse_options(args.options)
    except ValueError as err:
        raise OptionsError(f"--options: {err}") from None
    if contract_error is None:
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
    if json_path:
        _check_writable(json_path, "--json")
    if getattr(args, "junitxml", None):
        extra = [f"--junitxml={_check_writable(args.junitxml, '--junitxml')}", *extra]
    limit = float(getattr(args, "test_timeout", DEFAULT_TEST_TIMEOUT_S) or 0.0)

    def finish(code: int, threads: list[threading.Thread]) -> int:
        return _finish(args, name, options, collector, contract_error, json_path, code, threads)

    workdir = tempfile.TemporaryDirectory(prefix="hicache-check-", ignore_cleanup_errors=True)
    before = set(threading.enumerate())
    watchdog = Watchdog(collector, finish, Path(workdir.name)) if limit > 0 else None
    try:
        with isolated(Path(workdir.name)):
            pargs = _pytest_args(name, options, Path(workdir.name), extra, args.quiet, limit)
            code = int(pytest.main(pargs, plugins=[collector]))
    except OSError as err:  # pytest's own report files (--junitxml) failing at the end
        raise HiCacheError(
            f"pytest could not write {err.filename or 'a file'}: {err.strerror or err}"
        ) from None
    finally:
        if watchdog is not None:
            watchdog.close()
        left = remove_workdir(workdir)
    if left:
        collector.outcomes[CLEANUP_NODE] = ("failed", left)
        collector.rules[CLEANUP_NODE] = ("R2",)
    threads = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    args.hard_exit = any(not t.daemon for t in threads)  # they would hang the interpreter's exit
    return finish(code, threads)


def _finish(
    args: argparse.Namespace,
    name: str,
    options: dict[str, Any],
    collector: _Collector,
    contract_error: str | None,
    json_path: str | None,
    code: int,
    threads: list[threading.Thread],
) -> int:
    """Print the summary (and the rules), write ``--json``; return the exit code."""
    summary = summarize(collector.outcomes)
    if getattr(args, "rules", False):
        _print_rules(name, rule_summary(collector.outcomes, collector.rules))
    failed = sum(g.failed for g in summary.values()) + len(collector.collect_errors)
    passed = sum(g.passed for g in summary.values())
    exit_code = 1 if failed else (code or (0 if passed else _NO_TESTS))
    left = thread_notes(threads)
    _print(name, summary, collector.collect_errors, contract_error, exit_code, left)
    if json_path:
        data = report(name, options, summary, collector, code, exit_code, contract_error)
        _write_json(json_path, {**data, "threads_left": left})
    if not failed and exit_code:
        print(f"hicache check: {_why(code, exit_code)}; see pytest's output above")
    return exit_code


_NO_TESTS = 5  # pytest's own code for "no tests collected"
_PYTEST_CODES = {
    2: "the run was interrupted",
    3: "pytest hit an internal error",
    4: "pytest refused its command line (a bad argument after `--`?)",
    5: "no test was collected (check the -k / test names after `--`)",
}


def _why(code: int, exit_code: int) -> str:
    """Why a run in which no test failed is still not a pass."""
    if code == 0:
        return f"no test passed (every selected test was skipped), so nothing is certified (exit {exit_code})"
    return f"pytest exited with code {code}: {_PYTEST_CODES.get(code, 'see pytest -h')}; nothing is certified"


def _check_writable(path: str, flag: str) -> str:
    """The absolute path of a report file, checked writable before the suite runs (not after)."""
    target = Path(path).expanduser().absolute()
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a", encoding="utf-8"):
            pass
        if not existed:
            target.unlink()
    except OSError as err:
        raise HiCacheError(f"{flag}: cannot write {target}: {err.strerror or err}") from None
    return str(target)


def report(
    name: str,
    options: Mapping[str, Any],
    summary: Mapping[str, GroupSummary],
    collector: _Collector,
    pytest_code: int,
    exit_code: int,
    contract_error: str | None = None,
) -> dict[str, Any]:
    """The ``--json`` document: verdict, totals, per-group counts and every test's outcome."""
    from ..plugin import find_backends
    from ..testing import group_of

    info = find_backends().get(name)
    totals = {
        k: sum(getattr(g, k) for g in summary.values()) for k in ("passed", "failed", "skipped", "xfailed")
    }
    failed = totals["failed"] + len(collector.collect_errors)
    return {
        "schema": JSON_SCHEMA,
        "backend": name,
        "distribution": info.distribution if info else None,
        "version": info.version if info else None,
        "option_names": sorted(options),  # names only: values may hold credentials
        "verdict": "failed" if failed else ("passed" if exit_code == 0 else "error"),
        "exit_code": exit_code,
        "pytest_exit_code": pytest_code,
        "contract_error": contract_error,
        "totals": totals,
        "groups": {
            group: {
                "passed": g.passed,
                "failed": g.failed,
                "skipped": g.skipped,
                "xfailed": g.xfailed,
                "skip_reasons": dict(g.reasons),
                "failures": list(g.failures),
            }
            for group, g in summary.items()
        },
        "tests": [
            {
                "test": nodeid.rsplit("::", 1)[-1],
                "group": group_of(nodeid),
                "rules": list(collector.rules.get(nodeid, ())),
                "outcome": outcome,
                "detail": detail,
            }
            for nodeid, (outcome, detail) in collector.outcomes.items()
        ],
        "rules": {
            rid: {
                "topic": r.topic,
                "text": r.text,
                "tests": r.tests,
                "result": r.result,
                "skip_reasons": dict(r.reasons),
                "failures": list(r.failures),
            }
            for rid, r in rule_summary(collector.outcomes, collector.rules).items()
        },
        "collection_errors": list(collector.collect_errors),
    }


def _write_json(path: str, data: Mapping[str, Any]) -> None:
    target = Path(path).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, target)
    except OSError as err:
        raise HiCacheError(f"--json: cannot write {target}: {err.strerror or err}") from None


def _print_rules(name: str, rules: Mapping[str, RuleSummary]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"hicache check {name}: the rules of the backend contract", show_lines=False)
    table.add_column("rule", no_wrap=True)
    table.add_column("topic", max_width=22, overflow="fold")
    table.add_column("tests", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("notes (failing tests, skip reasons)", overflow="fold")
    styles = {"failed": "red", "passed": "green", "skipped": "yellow", "xfailed": "yellow"}
    for rid, r in rules.items():
        notes = [f"FAILED {_short(t)}" for t in r.failures[:3]]
        if r.result == "skipped":
            notes += [f"{reason} (x{n})" if n > 1 else reason for reason, n in r.reasons.items()]
        tests = "\n".join(r.tests) if r.tests else "(no test)"
        row = (rid, r.topic, tests, r.result, "\n".join(notes))
        table.add_row(*(escape(c) for c in row), style=styles.get(r.result, "magenta"))
    Console(width=max(120, Console().width)).print(table)


def _print(
    name: str,
    summary: dict[str, GroupSummary],
    collect_errors: list[str],
    contract_error: str | None = None,
    exit_code: int = 0,
    threads_left: list[str] | None = None,
) -> None:
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
        notes = [f"FAILED {_short(t)}" for t in g.failures]
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
    if contract_error:
        console.print(f"[red]the backend breaks the contract when loaded:[/red] {escape(contract_error)}")
    if threads_left:
        shown = "; ".join(threads_left[:5]) + ("; ..." if len(threads_left) > 5 else "")
        console.print(
            f"[yellow]{len(threads_left)} thread(s) started during the run still run:[/yellow] {escape(shown)}"
        )
    verdict = (
        "[red]FAILED[/red]"
        if totals.failed or collect_errors
        else ("[green]PASSED[/green]" if exit_code == 0 else f"[red]NOT CERTIFIED (exit {exit_code})[/red]")
    )
    console.print(
        f"backend {name!r}: {verdict} - {totals.passed} passed, {totals.failed} failed, "
        f"{totals.skipped} skipped, {totals.xfailed} xfailed"
    )
