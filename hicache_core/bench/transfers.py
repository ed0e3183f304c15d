"""Run one controller operation over every request, concurrently, with a progress bar.

Requests are submitted with the controller's ``*_async`` methods, as an engine does, so up to
``io_threads`` batches are in flight; the wall time from the first submit to the last result is
the phase time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, as_completed
from contextlib import contextmanager
from typing import Any, Literal, Protocol

from ..transfer import CacheController, QueryResult, TransferResult
from .profiles import ModelProfile, Request

__all__ = ["Bar", "progress_bar", "run_phase"]

Op = Literal["backup", "prefetch", "query"]


class Bar(Protocol):
    """What a phase needs from a progress display."""

    def start(self, description: str, total: int) -> None: ...

    def advance(self, amount: int) -> None: ...


class _NullBar:
    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass


class _RichBar:
    def __init__(self, progress: object) -> None:
        from rich.progress import Progress, TaskID

        assert isinstance(progress, Progress)
        self._progress = progress
        self._task: TaskID | None = None

    def start(self, description: str, total: int) -> None:
        self._task = self._progress.add_task(description, total=total)

    def advance(self, amount: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, amount)


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Bar]:
    """A rich progress display on stderr (pages done per phase), or a no-op when disabled."""
    if not enabled:
        yield _NullBar()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("pages"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as progress:
        yield _RichBar(progress)


def run_phase(
    ctl: CacheController,
    op: Op,
    profile: ModelProfile,
    reqs: Sequence[Request],
    hashes: Sequence[Sequence[str]],
    bar: Bar,
) -> tuple[float, list[TransferResult | QueryResult]]:
    """Submit ``op`` for every request; return (wall seconds, results in request order).

    ``bar`` advances by each request's pages as it completes (the caller starts the bar).
    """
    submit: dict[Op, Callable[[Request, Sequence[str]], Future[Any]]] = {
        "backup": lambda r, h: ctl.backup_async(h, r.kv_indices, r.extra(profile)),
        "prefetch": lambda r, h: ctl.prefetch_async(h, r.kv_indices, r.extra(profile)).future,
        "query": lambda r, h: ctl.query_async(h),
    }
    results: list[TransferResult | QueryResult | None] = [None] * len(reqs)
    t0 = time.perf_counter()
    futures: dict[Future[Any], Request] = {submit[op](r, h): r for r, h in zip(reqs, hashes)}
    for fut in as_completed(futures):
        r = futures[fut]
        results[r.index] = fut.result()
        bar.advance(r.pages)
    elapsed = time.perf_counter() - t0
    return elapsed, [x for x in results if x is not None]
