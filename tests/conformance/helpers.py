"""Helpers of the conformance tests (importable as ``tests.conformance.helpers``).

Besides writing throwaway distributions, this runs ``hicache check`` on the example backends of
``broken_backends*.py`` (:func:`run_checks`): a few worker processes (2 by default) each run the
real ``hicache check`` command in-process, one example after the other, taking the next example
not yet claimed, so the torch/pytest start-up is paid once per worker, not once per example.
An example may be checked against only some suite tests (``hicache check NAME -- -k ...``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PACKAGE = "hicache_broken_backends"
MODULE = PACKAGE  # the package the example backends are installed as
CHECK_TEST_TIMEOUT_S = 120  # per suite test, inside each `hicache check` (pytest-timeout)


def write_dist(site: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    """Write modules and a ``*.dist-info`` declaring ``hicache.backends`` entry points into ``site``.

    A module name may name a file of a package (``"pkg/__init__"``, ``"pkg/mod"``). Unlike
    ``tests.support.distinfo.installed_dist`` this does not touch ``sys.path``: the site is meant
    for subprocesses (``PYTHONPATH``), so other tests of this session never see it.
    """
    site.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        path = site / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    lines = ["[hicache.backends]", *(f"{n} = {v}" for n, v in entry_points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site


def write_examples_site(site: Path) -> Path:
    """Install every example of ``broken_backends*.py`` into ``site`` as ``hicache-broken-backends``.

    The modules are copied into package :data:`PACKAGE` (so the distribution looks like any
    third-party one); each example, and each extra backend, gets its entry point.
    """
    from tests.conformance.broken_backends import EXAMPLES, EXTRA_ENTRY_POINTS, MODULES

    modules = {f"{PACKAGE}/{m}": (HERE / f"{m}.py").read_text() for m in MODULES}
    modules[f"{PACKAGE}/__init__"] = '"""The example backends of hicache\'s tests/conformance."""\n'
    targets = {e.name: e.target for e in EXAMPLES} | EXTRA_ENTRY_POINTS
    eps = {name: f"{PACKAGE}.{target}" for name, target in targets.items()}
    return write_dist(site, "hicache-broken-backends", eps, modules)


def subprocess_env(*paths: Path) -> dict[str, str]:
    """The environment of a test subprocess: ``paths`` and the repository on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), str(REPO)])
    for var in ("PYTEST_ADDOPTS", "HICACHE_BACKENDS_ALLOW", "HICACHE_BACKENDS_BLOCK"):
        env.pop(var, None)
    return env


# ----------------------------------------------------------------- hicache check runs
_NAMED_RE = re.compile(r"FAILED (?:\S+::)?(test_[^\s:]+)")


@dataclass
class CheckRun:
    """One ``hicache check NAME`` run: exit code, per-test outcomes (JUnit) and its output."""

    name: str
    code: int
    seconds: float
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)
    output: str = ""

    @property
    def failed(self) -> list[str]:
        """Tests that failed or errored, in suite order."""
        return [t for t, (outcome, _) in self.outcomes.items() if outcome in ("failed", "error")]

    @property
    def named(self) -> set[str]:
        """Tests that ``hicache check`` printed as ``FAILED``."""
        return set(_NAMED_RE.findall(self.output))


def _junit(path: Path) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = f"{node.get('message', '')}\n{node.text or ''}"
                break
        name = case.get("name", "")
        if out.get(name, ("passed",))[0] not in ("failed", "error"):  # an error at teardown too
            out[name] = (outcome, text)
    return out


def _redirected(log: Path, fn: Callable[[list[str]], int], argv: list[str]) -> int:
    """``fn(argv)`` with file descriptors 1 and 2 (so ``sys.stdout``/``sys.stderr``) sent to ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            return fn(argv)
        except BaseException:  # recorded in the log; the worker goes on with the next example
            traceback.print_exc()
            return -2
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def check_worker(spec_file: str) -> int:
    """A worker process: run ``hicache check`` on each unclaimed example of the spec, in-process."""
    spec = json.loads(Path(spec_file).read_text())
    out = Path(spec["out"])
    from hicache_core.cli import main

    for name in spec["names"]:
        try:
            os.close(os.open(out / f"{name}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another worker has it
        argv = ["check", name, "--", f"--junitxml={out / f'{name}.xml'}"]
        argv += ["-o", f"timeout={CHECK_TEST_TIMEOUT_S}"]
        if name in spec["select"]:
            argv += ["-k", " or ".join(spec["select"][name])]
        start = time.perf_counter()
        code = _redirected(out / f"{name}.log", main, argv)
        done = {"code": code, "seconds": time.perf_counter() - start}
        (out / f"{name}.json").write_text(json.dumps(done))
    return 0


_WORKER = (
    "import sys; from tests.conformance.helpers import check_worker; sys.exit(check_worker(sys.argv[1]))"
)


def _cost_first(names: Sequence[str]) -> list[str]:
    """Slow examples first (a shorter tail): ever-growing re-sets, a second process for
    ``shared``, files on disk, the rule examples (most are shared, persistent files)."""
    slow = ("reset-appends", "shared", "file", "rules-")
    return sorted(names, key=lambda n: next((i for i, s in enumerate(slow) if s in n), len(slow)))


def run_checks(
    site: Path,
    names: Sequence[str],
    workdir: Path,
    jobs: int = 2,
    timeout: float = 900.0,
    select: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, CheckRun]:
    """``hicache check`` on each backend of ``names`` (installed in ``site``), at most ``jobs``
    at a time; returns name -> :class:`CheckRun` (code -1 when it did not finish in time).

    ``select`` maps a name to the suite tests to run for it (``-- -k "t1 or t2"``: pytest's
    substring match, so a test's parametrizations and same-prefixed tests run too); a name
    not in it gets the whole suite."""
    select = {name: list(tests) for name, tests in (select or {}).items()}
    for name, tests in select.items():
        bad = [t for t in tests if not re.fullmatch(r"test_[\w\[\]\-.]+", t)]
        if not tests or bad:
            raise ValueError(f"run_checks: select[{name!r}] must be suite test names, got {tests!r}")
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.json"
    spec.write_text(json.dumps({"names": _cost_first(names), "out": str(workdir), "select": select}))
    env = subprocess_env(site)
    procs = []
    for i in range(max(1, min(jobs, len(names)))):
        with open(workdir / f"worker-{i}.log", "w") as log:
            cmd = [sys.executable, "-c", _WORKER, str(spec)]
            procs.append(subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    results: dict[str, CheckRun] = {}
    for name in names:
        done = workdir / f"{name}.json"
        log = workdir / f"{name}.log"
        output = log.read_text(errors="replace") if log.exists() else ""
        if not done.exists():
            workers = "".join((workdir / f"worker-{i}.log").read_text()[-2000:] for i in range(len(procs)))
            results[name] = CheckRun(
                name, -1, timeout, {}, f"did not finish within {timeout:.0f}s\n{output}\n{workers}"
            )
            continue
        meta = json.loads(done.read_text())
        results[name] = CheckRun(name, meta["code"], meta["seconds"], _junit(workdir / f"{name}.xml"), output)
    return results
