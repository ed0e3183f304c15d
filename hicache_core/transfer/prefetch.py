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
    ARCHITECTURE.md). ``result.pages`` is always honest. ``result(timeout)`` that runs out ends
    the prefetch before it raises :class:`TimeoutError`.
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
        """A deadline passed: stop, abandon what is in flight (staged) or wait for it (not staged:
        it moves pages straight into the host slots) and resolve to what was loaded."""
        self._stop.set()
        if self._abandon is None:
            return super().result()
        with self._lock:
            if not self.done():
                self.set_result(self._abandon())
        return super().result()

    def result(self, timeout: float | None = None) -> TransferResult:
        """The prefetch's result under the policy (see the class docstring).

        ``timeout`` (seconds): when it passes first, the prefetch is ended before
        :class:`TimeoutError` is raised, so the caller may reuse its host slots at once: a staged
        prefetch is abandoned at once, any other stops after the batch in flight (this waits for
        that batch). The handle then holds the pages loaded by then (``result()`` returns them).
        Poll with :meth:`done`, not with ``result(timeout=0)``.
        """
        if self.policy is PrefetchPolicy.TIMEOUT:
            remaining = max(0.0, self.timeout_s - (time.monotonic() - self._t0))
            if timeout is None or timeout >= remaining:
                try:
                    return super().result(timeout=remaining)
                except FuturesTimeout:
                    return self._expire()
        try:
            return super().result(timeout=timeout)
        except FuturesTimeout:
            self._expire()  # nothing of it touches the host slots once we raise
            raise
