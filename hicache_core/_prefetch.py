"""``PrefetchHandle``: an asynchronous prefetch that honours the configured prefetch policy."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from ._config import PrefetchPolicy
from ._results import TransferResult

__all__ = ["PrefetchHandle"]


class PrefetchHandle:
    """An async prefetch: ``result()`` waits according to the prefetch policy.

    ``wait_complete`` / ``best_effort``: wait for completion (``best_effort`` callers may call
    :meth:`terminate` at any time to stop after the current batch). ``timeout``: wait up to
    ``prefetch_timeout_s``, then stop after the current batch and return what was loaded.
    """

    def __init__(
        self, future: Future[TransferResult], stop: threading.Event, policy: PrefetchPolicy, timeout_s: float
    ):
        self.future = future
        self._stop = stop
        self.policy = policy
        self.timeout_s = timeout_s
        self._t0 = time.monotonic()

    def done(self) -> bool:
        return self.future.done()

    def terminate(self) -> TransferResult:
        """Stop after the batch in flight and return what was loaded."""
        self._stop.set()
        return self.future.result()

    def result(self, timeout: float | None = None) -> TransferResult:
        if self.policy is PrefetchPolicy.TIMEOUT:
            remaining = max(0.0, self.timeout_s - (time.monotonic() - self._t0))
            try:
                return self.future.result(timeout=remaining if timeout is None else min(timeout, remaining))
            except TimeoutError:
                return self.terminate()
        return self.future.result(timeout=timeout)
