"""``CallPool``: the threads that run backend calls bounded by ``io_timeout_s``.

A call that does not answer in time is abandoned by its operation but keeps its thread until the
backend returns, which for a hung backend is never. So the threads are daemon threads (a hung
call never keeps the process from exiting), and once every thread is held by such a call, new
calls fail at once with :class:`BackendTimeoutError` instead of queueing without bound (each with
its staging copy of the pages) and waiting out their own timeout.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ..errors import BackendTimeoutError, ClosedError

__all__ = ["CallPool"]

T = TypeVar("T")


class CallPool:
    """``workers`` daemon threads, started on first use, running submitted calls in order."""

    def __init__(self, workers: int, name: str = "hicache-call") -> None:
        self.workers = workers
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._stuck = 0  # calls abandoned by their operation that still hold a thread

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise ClosedError("the call pool is shut down (its controller is closed)")
            if self._stuck >= self.workers:
                raise BackendTimeoutError(
                    f"all {self.workers} call threads are held by backend calls that did not answer "
                    "within io_timeout_s; the backend looks stuck, so this call fails at once"
                )
            if not self._started:
                self._started = True
                for i in range(self.workers):
                    threading.Thread(target=self._work, name=f"{self.name}_{i}", daemon=True).start()
            self._queue.put((future, fn))
        return future

    def abandoned(self, future: Future[Any]) -> None:
        """The caller stopped waiting for ``future``: cancel it if it has not started, else count
        its thread as held until the backend returns."""
        if future.cancel():
            return
        with self._lock:
            self._stuck += 1
        future.add_done_callback(self._released)

    def _released(self, _: Future[Any]) -> None:
        with self._lock:
            self._stuck -= 1

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as err:  # handed to the waiting caller, as an executor does
                future.set_exception(err)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Cancel the calls not started and let the threads end (a held one when its call returns)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        if started:
            for _ in range(self.workers):
                self._queue.put(None)
