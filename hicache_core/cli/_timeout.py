"""pytest plugin of ``hicache check``: a time limit per test phase (``--hicache-test-timeout S``).

Loaded with ``-p hicache_core.cli._timeout`` (no dependency beyond pytest). Each phase of a test
(setup, call, teardown) gets ``S`` seconds: a ``SIGALRM`` timer in the main thread raises
:class:`TimeLimitExceeded` where the test is stuck, so the test fails with "test exceeded S s: the
backend did not answer (in FILE:LINE FUNC)" and the run goes on. Threads the test started and
that are stuck in the backend stay behind (``hicache check`` reports them). A timer already armed
by an outer harness (pytest-timeout's signal method) is kept: its handler runs at its own
deadline and its remaining time is restored after the phase.

Two fallbacks for a hang a signal cannot interrupt: :data:`current` names the running phase so
that ``hicache check``'s watchdog thread can print the summary and stop the run (a call blocked in
native code that released the GIL), and ``faulthandler`` dumps every thread's stack and exits
(native code that holds the GIL) :data:`HARD_GRACE_S` seconds after that.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sysconfig
import threading
import time
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

__all__ = ["HARD_GRACE_S", "OPTION", "RETRY_S", "TimeLimitExceeded", "current"]

OPTION = "--hicache-test-timeout"
RETRY_S = 2.0
"""After the first alarm, the alarm repeats this often until the phase ends (a backend that
catches every exception and tries again)."""
HARD_GRACE_S = 60.0
"""Seconds after the time limit (plus the watchdog's grace) before faulthandler ends the process."""

try:  # the real stderr, taken before pytest's capture redirects descriptor 2 (plugins load first)
    _STDERR_FD: int | None = os.dup(2)
except OSError:  # pragma: no cover - no stderr at all
    _STDERR_FD = None

current: tuple[str, str, float, float] | None = None
"""``(nodeid, phase, monotonic start, limit)`` of the phase running in this process, else None."""


class TimeLimitExceeded(BaseException):
    """A test phase ran out of time. A ``BaseException``: a backend's ``except Exception`` does
    not swallow it, and hypothesis does not retry the example."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("hicache").addoption(
        OPTION,
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="fail a test phase (setup, call, teardown) that runs longer than SECONDS (0: no limit)",
    )


def _where(frame: FrameType | None) -> str:
    """Where the main thread was stuck: the innermost frame and, when that is in the standard
    library (a lock, a sleep), the innermost frame outside it."""
    spots: list[str] = []
    while frame is not None:
        code = frame.f_code
        if not spots or not code.co_filename.startswith(_STDLIB):
            spots.append(f"{'/'.join(Path(code.co_filename).parts[-2:])}:{frame.f_lineno} {code.co_name}")
            if not code.co_filename.startswith(_STDLIB):
                break
        frame = frame.f_back
    return "in " + " called from ".join(spots) if spots else "where: unknown"


_STDLIB = sysconfig.get_paths()["stdlib"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _limited(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _limited(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _limited(item, "teardown"))


def _limited(item: pytest.Item, phase: str) -> Generator[None, Any, Any]:
    global current
    limit = float(item.config.getoption("hicache_test_timeout", 0.0) or 0.0)
    if limit <= 0 or threading.current_thread() is not threading.main_thread():
        return (yield)
    start = time.monotonic()
    deadline = start + limit
    prev_handler = signal.getsignal(signal.SIGALRM)
    prev_delay, prev_interval = signal.getitimer(signal.ITIMER_REAL)
    outer = start + prev_delay if prev_delay > 0 else None

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if outer is not None and now >= outer - 1e-3 and callable(prev_handler):
            prev_handler(signum, frame)  # the outer harness's own deadline (it usually raises)
        if now < deadline - 1e-3:
            signal.setitimer(signal.ITIMER_REAL, deadline - now)
            return
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        raise TimeLimitExceeded(f"test exceeded {limit:g} s: the backend did not answer ({_where(frame)})")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, min(limit, prev_delay) if outer is not None else limit)
    current = (item.nodeid, phase, start, limit)
    if _STDERR_FD is not None:
        faulthandler.dump_traceback_later(
            limit + watchdog_grace(limit) + HARD_GRACE_S, exit=True, file=_STDERR_FD
        )
    try:
        return (yield)
    finally:
        current = None
        if _STDERR_FD is not None:
            faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, prev_handler if prev_handler is not None else signal.SIG_DFL)
        if outer is not None:
            signal.setitimer(signal.ITIMER_REAL, max(outer - time.monotonic(), 1e-3), prev_interval)


def watchdog_grace(limit: float) -> float:
    """Seconds past the limit before ``hicache check``'s watchdog stops a run whose stuck test
    the alarm could not interrupt."""
    return min(max(limit / 4, 10.0), 60.0)
