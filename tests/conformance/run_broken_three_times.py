"""Run ``hicache check`` (the whole suite) three times against every example backend.

Usage, from the repository root::

    .venv/bin/python tests/conformance/run_broken_three_times.py [--runs 3] [--jobs 2] [--only NAME ...]

Every broken example of ``broken_backends*.py`` must fail all three runs, and every correct one
must pass all three. Prints, per example, the runs that failed out of the total and the suite
tests that caught it (those recorded in ``EXAMPLES`` first, then how many others failed too).
Exit code 0 only when every example behaved in every run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.conformance.broken_backends import EXAMPLES  # noqa: E402
from tests.conformance.helpers import CheckRun, run_checks, write_examples_site  # noqa: E402


def _caught(example_tests: tuple[str, ...], runs: list[CheckRun]) -> str:
    """The failing tests of an example over its runs: recorded ones first, then the others."""
    always = set.intersection(*(set(r.failed) for r in runs)) if runs else set()
    ever: dict[str, None] = {}
    for r in runs:
        ever.update(dict.fromkeys(r.failed))
    recorded = [t for t in example_tests if t in always]
    others = [t for t in ever if t not in recorded]
    parts = recorded + others[: max(0, 4 - len(recorded))]
    more = len(others) - max(0, 4 - len(recorded))
    text = ", ".join(parts) if parts else "-"
    if more > 0:
        text += f" (+{more} more)"
    flaky = [t for t in parts if t not in always]
    if flaky:
        text += f"  [not in every run: {', '.join(flaky)}]"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="hicache check processes at a time (default 2)")
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME", help="only these examples")
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep logs and JUnit reports in this directory"
    )
    args = parser.parse_args(argv)
    examples = [e for e in EXAMPLES if not args.only or e.name in args.only]
    with tempfile.TemporaryDirectory(prefix="hicache-broken-") as tmp:
        base = args.keep or Path(tmp)
        site = write_examples_site(base / "site")
        runs: dict[str, list[CheckRun]] = {e.name: [] for e in examples}
        for i in range(args.runs):
            start = time.perf_counter()
            results = run_checks(site, [e.name for e in examples], base / f"run-{i + 1}", jobs=args.jobs)
            print(f"run {i + 1}/{args.runs}: {len(examples)} examples in {time.perf_counter() - start:.1f}s")
            for name, run in results.items():
                runs[name].append(run)
    print()
    print(f"{'example':34} {'expect':6} {'failed':>7}  caught by (recorded tests first)")
    bad = 0
    for e in examples:
        failed = sum(r.code == 1 for r in runs[e.name])
        odd = [r.code for r in runs[e.name] if r.code not in (0, 1)]
        ok = failed == args.runs if e.broken else failed == 0 and not odd
        bad += not ok
        mark = "" if ok else "   <-- UNEXPECTED"
        codes = f"  exit codes {odd}" if odd else ""
        expect = "fail" if e.broken else "pass"
        tests = _caught(e.caught_by, runs[e.name])
        print(f"{e.name:34} {expect:6} {failed:>3}/{args.runs:<3}  {tests}{codes}{mark}")
    print()
    n_broken = sum(e.broken for e in examples)
    print(
        f"{n_broken} broken examples, {len(examples) - n_broken} correct ones, {args.runs} runs: "
        + ("every example behaved in every run" if not bad else f"{bad} example(s) did not")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
