"""Every rule of the backend contract is a named test: the coverage of ``hicache_core.testing.RULES``.

* CONTRIBUTING.md states the same rules, in the same order, with the same words;
* every rule has at least one suite test, every suite test names at least one rule and only rules
  that exist, and its docstring names each of them;
* ``hicache check NAME --rules`` prints every rule with its tests and their result, and ``--json``
  carries the same table.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

from hicache_core.testing import RULES, BackendConformance, rule, rules_of
from tests.conformance.helpers import REPO, subprocess_env

RULE_LINE = re.compile(r"^- \*\*(R\d+)\*\* \(([^)]*)\) (.*)$")


def suite_tests(cls: type) -> dict[str, object]:
    """Every test function of a suite class (``test_*``), by name."""
    return {name: fn for name, fn in inspect.getmembers(cls, inspect.isfunction) if name.startswith("test_")}


def coverage_problems(cls: type) -> list[str]:
    """What breaks the rule coverage of suite class ``cls`` (empty when every rule is covered)."""
    problems: list[str] = []
    covered: dict[str, list[str]] = {rid: [] for rid in RULES}
    for name, fn in suite_tests(cls).items():
        ids = rules_of(fn)
        if not ids:
            problems.append(f"{name} names no rule (tag it with @rule(...))")
        doc = inspect.getdoc(fn) or ""
        for rid in ids:
            if rid not in RULES:
                problems.append(f"{name} names {rid}, which is not a rule")
                continue
            covered[rid].append(name)
            if not re.search(rf"\b{rid}\b", doc):
                problems.append(f"{name} checks {rid} but its docstring does not say so")
    problems += [f"{rid} ({RULES[rid].topic}) has no test" for rid, tests in covered.items() if not tests]
    return problems


def test_rule_ids_are_numbered() -> None:
    assert list(RULES) == [f"R{i}" for i in range(1, len(RULES) + 1)]
    assert all(r.text.strip() and r.topic.strip() for r in RULES.values())
    assert len({r.topic for r in RULES.values()}) == len(RULES), "each rule has a topic of its own"


def test_contributing_states_the_rules() -> None:
    """CONTRIBUTING.md's numbered list (between the ``rules`` markers) equals ``RULES``."""
    text = (REPO / "CONTRIBUTING.md").read_text()
    block = text.split("<!-- rules: begin -->", 1)[1].split("<!-- rules: end -->", 1)[0]
    listed = [RULE_LINE.match(line) for line in block.strip().splitlines()]
    assert all(listed), [line for line, m in zip(block.strip().splitlines(), listed) if not m]
    doc = {m.group(1): (m.group(2), m.group(3)) for m in listed if m}
    assert list(doc) == list(RULES), f"CONTRIBUTING.md lists {list(doc)}, RULES holds {list(RULES)}"
    for rid, (topic, sentence) in doc.items():
        assert (topic, sentence) == (RULES[rid].topic, RULES[rid].text), f"{rid} differs:\n{sentence}"


def test_every_rule_has_a_test() -> None:
    """Every rule has a test; every test names existing rules and says which in its docstring."""
    problems = coverage_problems(BackendConformance)
    assert not problems, "\n".join(problems)


def test_coverage_check_fails_when_it_should() -> None:
    """The coverage check itself: an unknown rule, an untagged test and an uncovered rule are found."""

    class Lacking:
        @rule("R1", "R999")
        def test_discovery_x(self) -> None:
            """R1, R999: one real rule and one that does not exist."""

        @rule("R2")
        def test_discovery_y(self) -> None:
            """Does not name its rule."""

        def test_discovery_z(self) -> None:
            """No tag."""

    problems = coverage_problems(Lacking)
    assert "test_discovery_x names R999, which is not a rule" in problems
    assert "test_discovery_y checks R2 but its docstring does not say so" in problems
    assert "test_discovery_z names no rule (tag it with @rule(...))" in problems
    assert f"R3 ({RULES['R3'].topic}) has no test" in problems


def test_check_prints_the_rules(broken_site: Path, tmp_path: Path) -> None:
    """``hicache check NAME --rules``: every rule, its tests, the result; a skipped rule shows the
    capability that skips it; ``--json`` has the same table and each test's rules."""
    out = tmp_path / "check.json"
    cmd = [
        sys.executable,
        "-m",
        "hicache_core.cli",
        "check",
        "good-memory",
        "--rules",
        "-q",
        "--json",
        str(out),
    ]
    proc = subprocess.run(
        [*cmd, "--", "-k", "discovery or test_shared_two"],
        cwd=tmp_path, env=subprocess_env(broken_site), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("the rules of the backend contract", 1)[1]
    for rid in RULES:
        assert re.search(rf"\b{rid}\b", table), f"{rid} is not in the --rules table:\n{table[:4000]}"
    assert "test_shared_two_stores" in table and "does not declare capabilities.shared" in table
    data = json.loads(out.read_text())
    rules = data["rules"]
    assert list(rules) == list(RULES)
    assert rules["R1"]["result"] == "passed" and "test_discovery_metadata" in rules["R1"]["tests"]
    assert rules["R30"]["result"] == "skipped"
    assert any("capabilities.shared" in reason for reason in rules["R30"]["skip_reasons"])
    assert rules["R8"]["result"] == "not run" and rules["R8"]["tests"]
    by_test = {t["test"]: t["rules"] for t in data["tests"]}
    assert by_test["test_discovery_open_close"] == ["R2"]
