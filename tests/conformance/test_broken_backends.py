"""The suite must fail deliberately broken backends, each defect by a named test.

The backends in ``broken_backends.py`` are installed as a throwaway distribution and the suite
runs against all of them in ONE pytest subprocess (a generated test module with one
``BackendConformance`` subclass per backend; each defect runs the groups of the tests that must
catch it, plus ``discovery`` and ``contract``). The JUnit report then tells, per backend, which
tests failed: every defect's named tests must fail with a message saying why, the correct
reference backend must pass the whole suite, and discovery must still pass for every defect (so
each failure comes from the defect, not from a broken setup).
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hicache_core.testing import group_of
from tests.conformance.broken_backends import DEFECTS
from tests.conformance.helpers import subprocess_env

CONFTEST = """
from hicache_core.testing import group_of

ALLOWED = {allowed!r}


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        groups = ALLOWED.get(item.cls.__name__)
        (keep if groups is None or group_of(item.name) in groups else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
"""


XFAILS = {
    "test_prefix_hole_ends_prefix": "known defect: exists ignores holes",
    "test_discovery_metadata": "wrongly listed: this test passes",
}


def _class_name(backend: str) -> str:
    return "Test_" + backend.replace("-", "_")


@pytest.fixture(scope="module")
def junit(
    broken_site: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, tuple[str, str]]]:
    """Run the suite against every backend in DEFECTS; return class -> test -> (outcome, text)."""
    root = tmp_path_factory.mktemp("broken")
    suite_dir = root / "suite"
    suite_dir.mkdir()
    lines = ["from hicache_core.testing import BackendConformance", ""]
    for name in DEFECTS:
        lines += [f"class {_class_name(name)}(BackendConformance):", f"    backend = {name!r}", ""]
    lines += [
        "class Test_expected_failures(BackendConformance):",
        "    backend = 'broken-holes'",
        f"    expected_failures = {XFAILS!r}",
        "",
    ]
    (suite_dir / "test_broken_suite.py").write_text("\n".join(lines))
    # A defect's class runs the groups of its named tests plus discovery and contract (a full
    # suite per defect would only add time); the reference backend runs everything.
    allowed = {
        _class_name(name): sorted({"discovery", "contract", *(group_of(t) for t in must_fail)})
        for name, (_, must_fail, _) in DEFECTS.items()
        if must_fail
    }
    allowed["Test_expected_failures"] = ["discovery", "prefix"]
    (suite_dir / "conftest.py").write_text(CONFTEST.format(allowed=allowed))
    report = root / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(suite_dir), "-q", "-p", "no:cacheprovider",
         "--rootdir", str(suite_dir), "-o", "addopts=", "--tb=short", f"--junitxml={report}"],
        cwd=suite_dir, env=subprocess_env(broken_site), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert report.exists(), (
        f"pytest did not run (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        outcome, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = f"{node.get('message', '')}\n{node.text or ''}"
                break
        out.setdefault(cls, {})[case.get("name", "")] = (outcome, text)
    return out


def test_reference_backend_passes(junit: dict[str, dict[str, tuple[str, str]]]) -> None:
    results = junit[_class_name("good-memory")]
    bad = {name: r[1][-600:] for name, r in results.items() if r[0] in ("failed", "error")}
    assert not bad, f"the correct reference backend failed: {bad}"
    assert sum(r[0] == "passed" for r in results.values()) >= 50


@pytest.mark.parametrize("backend", [name for name in DEFECTS if name != "good-memory"])
def test_defect_is_caught_by_name(junit: dict[str, dict[str, tuple[str, str]]], backend: str) -> None:
    _, must_fail, reason = DEFECTS[backend]
    results = junit[_class_name(backend)]
    for test in must_fail:
        outcome, text = results[test]
        assert outcome == "failed", f"{backend}: {test} should fail but {outcome}"
        assert reason in text, f"{backend}: {test} failed without saying {reason!r}:\n{text[-1500:]}"
    for test in (
        "test_discovery_entry_point_resolves",
        "test_discovery_metadata",
        "test_contract_page_keys_safe",
    ):
        assert results[test][0] == "passed", f"{backend}: {test} should pass: {results[test][1][-800:]}"


def test_expected_failures_are_strict_xfails(junit: dict[str, dict[str, tuple[str, str]]]) -> None:
    """``expected_failures`` marks a failing test xfail with its reason; a passing one fails (strict)."""
    results = junit["Test_expected_failures"]
    outcome, text = results["test_prefix_hole_ends_prefix"]
    assert outcome == "skipped" and "known defect: exists ignores holes" in text, (outcome, text)
    outcome, text = results["test_discovery_metadata"]
    assert outcome == "failed" and "XPASS(strict)" in text, (outcome, text)
    assert results["test_prefix_exists_reports_each_page"][0] == "failed"
    assert results["test_discovery_open_close"][0] == "passed"
