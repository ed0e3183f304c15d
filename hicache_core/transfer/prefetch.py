"""``PrefetchHandle``: an asynchronous prefetch that honours the configured prefetch policy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout

from ..config import PrefetchPolicy
from .results import TransferResult

__all__ = ["PrefetchHandle"]


class PrefetchHandle(Future[TransferResult]):
    """An async prefetch: a real :class:`concurrent.futures.Future` whose ``result()`` honours
    the prefetch policy.

    ``wait_complete`` / ``best_effort``: ``result()`` waits for completion (``best_effort``
    callers may call :meth:`terminate` at any time to stop after the current batch).
    ``timeout``: ``result()`` returns by ``prefetch_timeout_s`` after submission (plus the time
    of one in-flight copy into host memory), even when the backend never answers: the prefetch
    is abandoned at the deadline and the handle resolves to the pages loaded by then; nothing of
    it touches the host slots afterwards (the controller stages such prefetches, see
    ARCHITECTURE.md). ``result.pages`` is always honest.
    """

    def __init__(
        self,
        future: Future[TransferResult],
        stop: threading.Event,
        policy: PrefetchPolicy,
        timeout_s: float,
        abandon: Callable[[], TransferResult] | None = None,
    ) -> None:
        super().__init__()
        self.future = future
        self._stop = stop
        self.policy = policy
        self.timeout_s = timeout_s
        self._abandon = abandon
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        future.add_done_callback(self._relay)

    def _relay(self, inner: Future[TransferResult]) -> None:
        with self._lock:
            if self.done():  # resolved at the deadline already
                return
            if inner.cancelled():
                super().cancel()
                return
            err = inner.exception()
            if err is not None:
                self.set_exception(err)
            else:
                self.set_result(inner.result())

    def cancel(self) -> bool:
        """Cancel if not started; a running prefetch is asked to stop after its current batch."""
        self._stop.set()
        return self.future.cancel() and super().cancel()

    def terminate(self) -> TransferResult:
        """Stop after the batch in flight and return what was loaded."""
        self._stop.set()
        return super().result()

    def _expire(self) -> TransferResult:
        """The deadline passed: stop, abandon what is in flight and resolve to what was loaded."""
        self._stop.set()
        if self._abandon is None:
            return super().result()
        with self._lock:
            if not self.done():
                self.set_result(self._abandon())
        return super().result()

    def result(self, timeout: float | None = None) -> TransferResult:
        if self.policy is PrefetchPolicy.TIMEOUT:
            remaining = max(0.0, self.timeout_s - (time.monotonic() - self._t0))
            if timeout is not None and timeout < remaining:
                return super().result(timeout=timeout)
            try:
                return super().result(timeout=remaining)
            except FuturesTimeout:
                return self._expire()
        return super().result(timeout=timeout)
