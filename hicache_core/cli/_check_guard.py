"""The parts of ``hicache check`` that keep a hostile backend from spoiling the run's verdict.

Plugins an option after ``--`` needs (auto-loading is off), an environment that writes nothing
into the working directory, removal of the run's temporary directory with retries (a backend
still writing after close is a failure), the threads a run left behind, and the watchdog that
ends a run stuck in a test the alarm of ``_timeout.py`` cannot interrupt.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["Watchdog", "isolated", "plugins_for", "remove_workdir", "thread_notes"]


RECHECK_S = 0.05
"""Pause before checking that the removed temporary directory stays removed."""

# options after `--` that need an installed plugin (auto-loading is off): it is loaded for them
_PLUGIN_OPTIONS = {"-n": "xdist", "--numprocesses": "xdist", "--dist": "xdist", "--timeout": "timeout"}
_PLUGIN_MODULES = {"xdist": "xdist", "timeout": "pytest_timeout"}  # loaded only when installed


def plugins_for(extra: list[str]) -> list[str]:
    """``-p NAME`` for each installed plugin an option of ``extra`` needs (``-o timeout=S`` too)."""
    names: dict[str, None] = {}
    for before, arg in zip(["", *extra], extra):
        flag = arg.split("=", 1)[0]
        if before == "-o" or flag == "--override-ini":  # an ini value: pytest-timeout's `timeout`
            flag = "--" + arg.removeprefix("--override-ini=").split("=", 1)[0]
        if flag.startswith("-n") and flag[2:3].isalnum():  # -n2, -nauto
            flag = "-n"
        plugin = _PLUGIN_OPTIONS.get(flag)
        if plugin is not None and plugin not in extra and f"-p{plugin}" not in extra:
            if importlib.util.find_spec(_PLUGIN_MODULES[plugin]) is not None:
                names[plugin] = None
    return [a for plugin in names for a in ("-p", plugin)]


@contextmanager
def isolated(workdir: Path) -> Iterator[None]:
    """Nothing written to the working directory during the run: no auto-loaded pytest plugin
    (pytest-benchmark writes ``.benchmarks/``), hypothesis's files (``.hypothesis/``, written
    even without a database) in ``workdir``."""
    names = ("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "HYPOTHESIS_STORAGE_DIRECTORY")
    saved = {k: os.environ.get(k) for k in names}
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = str(workdir / "hypothesis")
    configuration = sys.modules.get("hypothesis.configuration")  # already imported: it keeps the path
    if configuration is not None:
        configuration.set_hypothesis_home_dir(workdir / "hypothesis")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        configuration = sys.modules.get("hypothesis.configuration")
        if configuration is not None:
            configuration.set_hypothesis_home_dir(None)  # back to the environment or the default


def thread_notes(threads: list[threading.Thread]) -> list[str]:
    """``name (where it runs)`` of each thread the run left running."""
    frames = sys._current_frames()
    out = []
    for t in threads:
        frame = frames.get(t.ident) if t.ident is not None else None
        if frame is None:
            out.append(t.name)
        else:
            code = frame.f_code
            out.append(
                f"{t.name} (in {'/'.join(Path(code.co_filename).parts[-2:])}:{frame.f_lineno} {code.co_name})"
            )
    return out


def remove_workdir(workdir: tempfile.TemporaryDirectory[str]) -> str | None:
    """Remove the run's temporary directory, retrying while something still writes into it; when
    it cannot, the failure: what is left, where. A directory that reappears within
    :data:`RECHECK_S` of its removal (a thread re-creating a root) counts as not removed."""
    path = Path(workdir.name)
    for pause in (0.0, 0.1, 0.3, 1.0):
        time.sleep(pause)
        workdir.cleanup()
        if not os.path.lexists(path):
            time.sleep(RECHECK_S)
            if not os.path.lexists(path):
                return None
    files, tests = 0, set()
    for top, _dirs, names in os.walk(path):
        files += len(names)
        rel = Path(top).relative_to(path).parts
        if names and len(rel) >= 2 and rel[0] == "tmp":
            tests.add(rel[1])
    shown = ", ".join(sorted(tests)[:3]) + (", ..." if len(tests) > 3 else "")
    return (
        f"files still being written after close: {files} files left in {path}"
        + (f" (in the roots of {shown})" if tests else "")
        + " after 4 attempts to remove it; a backend's hicache_close must stop every thread and "
        "process that writes into its storage"
    )


class Watchdog:
    """Ends a run whose current test phase is stuck past its time limit plus a grace (an alarm
    cannot interrupt a call blocked in native code): the stuck test fails, the summary and
    ``--json`` are written to the command's real output (pytest's capture is bypassed), the
    process exits."""

    def __init__(
        self, collector: Any, finish: Callable[[int, list[threading.Thread]], int], workdir: Path
    ) -> None:
        self.collector, self.finish, self.workdir = collector, finish, workdir
        self.fds = (os.dup(1), os.dup(2))  # stdout / stderr before pytest captures them
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="hicache-check-watchdog", daemon=True).start()

    def close(self) -> None:
        with self.lock:
            self.stopped.set()
            for fd in self.fds:
                os.close(fd)

    def _watch(self) -> None:
        while not self.stopped.wait(1.0):
            plugin = sys.modules.get(f"{__package__}._timeout")  # imported by pytest (-p), not here
            cur = None if plugin is None else plugin.current
            if (
                plugin is None
                or cur is None
                or time.monotonic() - cur[2] <= cur[3] + plugin.watchdog_grace(cur[3])
            ):
                continue
            with self.lock:
                if not self.stopped.is_set():
                    self._stop_run(*cur)

    def _stop_run(self, nodeid: str, phase: str, _start: float, limit: float) -> None:
        self.collector.outcomes[nodeid] = (
            "failed",
            f"test exceeded {limit:g} s in its {phase} and could not be interrupted: the backend did not "
            f"answer; the run was stopped (the tests after it did not run; files may be left in "
            f"{self.workdir})",
        )
        code = 1
        try:
            for fd, real in zip(self.fds, (1, 2)):
                os.dup2(fd, real)
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            me = threading.current_thread()
            code = self.finish(2, [t for t in threading.enumerate() if t is not me and t.is_alive()])
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    if stream is not None:
                        stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code or 1)
