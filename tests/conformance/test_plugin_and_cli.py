"""The ``hicache`` pytest plugin and ``hicache check``, driven in subprocesses like a user would.

Backends come from ``broken_backends.py`` installed on ``PYTHONPATH`` (``good-memory`` is the
correct reference, ``broken-*`` have one defect each, ``unavailable-sdk`` needs a vendor SDK).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

from hicache_core.cli.check import summarize
from tests.conformance.helpers import subprocess_env, write_dist


def _run(args: list[str], site: Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=subprocess_env(site), capture_output=True, text=True, timeout=timeout, check=False
    )


def _pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]


def _hicache(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("hicache")
    return [
        str(script) if script.exists() else sys.executable,
        *([] if script.exists() else ["-m", "hicache_core.cli"]),
        *args,
    ]


# ------------------------------------------------------------------ the plugin
def test_plugin_import_is_light(tmp_path: Path) -> None:
    code = (
        "import sys, hicache_core.testing._plugin\n"
        "heavy = [m for m in ('torch', 'pydantic', 'hypothesis', 'hicache_core.testing._suite') if m in sys.modules]\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    proc = _run([sys.executable, "-X", "importtime", "-c", code], tmp_path, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert not [line for line in proc.stderr.splitlines() if re.search(r"\|\s+torch(\.|$)", line)]


def test_pyargs_without_backend_collects_nothing(broken_site: Path, tmp_path: Path) -> None:
    proc = _run(_pytest("--pyargs", "hicache_core.testing", "-q"), broken_site, tmp_path)
    assert proc.returncode == 5, proc.stdout[-2000:]  # "no tests ran": the suite is not collected
    assert "error" not in proc.stdout.lower()


def test_pyargs_runs_suite(broken_site: Path, tmp_path: Path) -> None:
    proc = _run(
        _pytest("--pyargs", "hicache_core.testing", "--hicache-backend", "good-memory", "-q",
                "-k", "discovery or contract or v1_roundtrip"),
        broken_site, tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"\b16 passed\b", proc.stdout), proc.stdout[-1000:]
    assert "hicache conformance: backend='good-memory'" in proc.stdout or "passed" in proc.stdout


def test_pyargs_in_project_with_other_python_files(broken_site: Path, tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\npython_files = check_*.py\naddopts = -q\n")
    proc = _run(
        _pytest("--pyargs", "hicache_core.testing", "--hicache-backend", "good-memory", "-k", "discovery"),
        broken_site, tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0 and re.search(r"\b4 passed\b", proc.stdout), proc.stdout[-3000:]


def test_plugin_options_file(broken_site: Path, tmp_path: Path) -> None:
    (tmp_path / "opts.json").write_text(json.dumps({}))
    args = ["--pyargs", "hicache_core.testing", "--hicache-backend", "good-memory", "-k", "discovery_open"]
    proc = _run(_pytest(*args, "--hicache-options", "@opts.json"), broken_site, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_plugin_usage_errors(broken_site: Path, tmp_path: Path) -> None:
    base = ["--pyargs", "hicache_core.testing"]
    proc = _run(_pytest(*base, "--hicache-backend", "nosuch"), broken_site, tmp_path)
    assert proc.returncode == 4 and "good-memory" in proc.stderr, proc.stderr[-2000:]
    proc = _run(
        _pytest(*base, "--hicache-backend", "good-memory", "--hicache-options", "{"), broken_site, tmp_path
    )
    assert proc.returncode == 4 and "not valid JSON" in proc.stderr, proc.stderr[-2000:]
    proc = _run(
        _pytest(*base, "--hicache-backend", "good-memory", "--hicache-options", '{"x": 1}'),
        broken_site,
        tmp_path,
    )
    assert proc.returncode == 4 and "options.x" in proc.stderr, proc.stderr[-2000:]
    proc = _run(_pytest(*base, "--hicache-options", "{}"), broken_site, tmp_path)
    assert proc.returncode == 4 and "--hicache-backend" in proc.stderr, proc.stderr[-2000:]
    proc = _run(_pytest(*base, "--hicache-backend", "unavailable-sdk"), broken_site, tmp_path)
    assert proc.returncode == 4 and "vendor SDK" in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------ hicache check
def test_check_unknown_backend_lists_installed(broken_site: Path, tmp_path: Path) -> None:
    proc = _run(_hicache("check", "nosuch"), broken_site, tmp_path)
    assert proc.returncode != 0
    assert "Installed backends:" in proc.stderr and "good-memory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_check_unavailable_and_bad_options(broken_site: Path, tmp_path: Path) -> None:
    proc = _run(_hicache("check", "unavailable-sdk"), broken_site, tmp_path)
    assert proc.returncode != 0 and "vendor SDK" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run(_hicache("check", "good-memory", "--options", '{"nope": 1}'), broken_site, tmp_path)
    assert proc.returncode != 0 and "options.nope" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run(_hicache("check", "good-memory", "--options", "@missing.json"), broken_site, tmp_path)
    assert proc.returncode != 0 and "cannot read options file" in proc.stderr


def test_check_reference_backend_passes(broken_site: Path, tmp_path: Path) -> None:
    proc = _run(_hicache("check", "good-memory", "-q"), broken_site, tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:] + proc.stderr[-2000:]
    for group in ("discovery", "contract", "v1", "v2", "isolation", "stateful", "persistence"):
        assert re.search(rf"│ {group}\s+│", out), f"group {group} missing from the table:\n{out[-3000:]}"
    assert "does not declare capabilities.persistent" in out  # skip reasons are shown
    m = re.search(r"PASSED - (\d+) passed, 0 failed", out)
    assert m and int(m[1]) >= 50, out[-2000:]


def test_check_broken_backend_fails(broken_site: Path, tmp_path: Path) -> None:
    # run from a project whose own conftest files would break any pytest run: check ignores them
    (tmp_path / "tests").mkdir()
    for conftest in (tmp_path / "conftest.py", tmp_path / "tests" / "conftest.py"):
        conftest.write_text("raise ImportError('this project conftest must not be loaded')\n")
    proc = _run(
        _hicache("check", "broken-holes", "-q", "--", "-k", "prefix or discovery"), broken_site, tmp_path
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "FAILED test_prefix_hole_ends_prefix" in proc.stdout
    m = re.search(r"FAILED - 4 passed, (\d+) failed", proc.stdout)  # discovery passes; prefix tests fail
    assert m and int(m[1]) >= 3, proc.stdout[-2000:]


def test_check_nothing_selected_is_not_success(broken_site: Path, tmp_path: Path) -> None:
    proc = _run(
        _hicache("check", "good-memory", "-q", "--", "-k", "no_such_test_name"), broken_site, tmp_path
    )
    assert proc.returncode != 0


def test_summarize_groups_outcomes() -> None:
    summary = summarize(
        {
            "a.py::T::test_v1_roundtrip[mha-0]": ("passed", ""),
            "a.py::T::test_v1_get_missing": ("failed", "AssertionError: x"),
            "a.py::T::test_v2_roundtrip[1]": ("skipped", "no v2"),
            "a.py::T::test_v2_roundtrip[2]": ("skipped", "no v2"),
            "a.py::T::test_shared_two_processes": ("xfailed", "sandbox"),
            "a.py::T::test_custom_thing": ("passed", ""),
        }
    )
    assert (summary["v1"].passed, summary["v1"].failed) == (1, 1)
    assert summary["v1"].failures == ["test_v1_get_missing: AssertionError: x"]
    assert summary["v2"].skipped == 2 and summary["v2"].reasons == {"no v2": 2}
    assert summary["shared"].xfailed == 1
    assert summary["other"].passed == 1


# ------------------------------------------------------------ machine-readable results
def test_check_json_and_junitxml(broken_site: Path, tmp_path: Path) -> None:
    out, xml = tmp_path / "results" / "check.json", tmp_path / "check.xml"
    args = ["check", "good-memory", "-q", "--json", str(out), "--junitxml", str(xml), "--", "-k", "discovery"]
    proc = _run(_hicache(*args), broken_site, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["schema"] == "hicache-check/1" and data["backend"] == "good-memory"
    assert data["verdict"] == "passed" and data["exit_code"] == 0 and data["contract_error"] is None
    assert data["distribution"] == "hicache-broken-backends"
    assert data["totals"] == {"passed": 4, "failed": 0, "skipped": 0, "xfailed": 0}
    assert data["groups"]["discovery"]["passed"] == 4
    assert {t["test"] for t in data["tests"]} == {
        "test_discovery_entry_point_resolves",
        "test_discovery_metadata",
        "test_discovery_open_close",
        "test_discovery_close_releases",
    }
    assert all(t["group"] == "discovery" and t["outcome"] == "passed" for t in data["tests"])
    cases = ElementTree.parse(xml).getroot().iter("testcase")
    assert len([c for c in cases if c.get("name", "").startswith("test_discovery")]) == 4


def test_check_json_reports_failures_and_errors(broken_site: Path, tmp_path: Path) -> None:
    out = tmp_path / "holes.json"
    proc = _run(
        _hicache("check", "broken-holes", "-q", "--json", str(out), "--", "-k", "prefix or discovery"),
        broken_site, tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    data = json.loads(out.read_text())
    assert data["verdict"] == "failed" and data["exit_code"] == 1
    assert data["totals"]["passed"] == 4 and data["totals"]["failed"] >= 3
    assert any(f.startswith("test_prefix_hole_ends_prefix") for f in data["groups"]["prefix"]["failures"])
    failed = [t for t in data["tests"] if t["outcome"] == "failed"]
    assert len(failed) == data["totals"]["failed"] and all(
        t["group"] == "prefix" and t["detail"] for t in failed
    )

    out = tmp_path / "unknown.json"
    proc = _run(_hicache("check", "nosuch", "--json", str(out)), broken_site, tmp_path)
    assert proc.returncode == 2 and "Installed backends" in proc.stderr
    data = json.loads(out.read_text())
    assert data["verdict"] == "error" and data["exit_code"] == 2 and "Installed backends" in data["error"]


LAX_OPTIONS = '''
from pydantic import ConfigDict
from tests.support.membackend import MemoryBackend


class LaxOptions(MemoryBackend):
    """Breaks: CONTRIBUTING.md 1.3, `Options` must forbid extras."""

    class Options(MemoryBackend.Options):
        model_config = ConfigDict(extra="allow")
'''


def test_options_defect_is_reported_by_the_suite_not_refused(tmp_path: Path) -> None:
    site = write_dist(
        tmp_path / "lax",
        "hicache-lax",
        {"lax-options": "hicache_lax:LaxOptions"},
        {"hicache_lax": LAX_OPTIONS},
    )
    out = tmp_path / "lax.json"
    proc = subprocess.run(
        _hicache("check", "lax-options", "-q", "--json", str(out), "--", "-k", "discovery or contract"),
        cwd=tmp_path, env=subprocess_env(site), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]  # failing tests, not exit 2
    assert "forbid unknown fields" in proc.stdout and "Traceback" not in proc.stderr
    data = json.loads(out.read_text())
    assert data["verdict"] == "failed" and "forbid unknown fields" in data["contract_error"]
    assert data["groups"]["contract"]["failed"] >= 1
    assert any(
        "forbid unknown fields" in t["detail"] for t in data["tests"] if t["outcome"] in ("failed", "error")
    )
    # the pytest plugin does not refuse it either: the suite runs and fails
    proc = subprocess.run(
        _pytest("--pyargs", "hicache_core.testing", "--hicache-backend", "lax-options", "-q", "-k", "contract"),
        cwd=tmp_path, env=subprocess_env(site), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "forbid unknown fields" in proc.stdout


def test_closed_pipe_ends_quietly(broken_site: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        _hicache("backends", "--json"), cwd=tmp_path, env=subprocess_env(broken_site),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write (`hicache backends --json | head -0`)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err
