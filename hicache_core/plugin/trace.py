"""Hook-call tracing (``HICACHE_TRACE=1``): every hook call logged with its plugins, batch size
and duration on the ``hicache.trace`` logger."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pluggy

__all__ = ["enable_tracing"]


def enable_tracing(pm: pluggy.PluginManager) -> Callable[[], None]:
    """Install a call monitor on ``pm``; returns the function that removes it."""
    trace_log = logging.getLogger("hicache.trace")
    starts: dict[int, float] = {}

    def before(hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        starts[threading.get_ident()] = time.perf_counter()

    def after(outcome: Any, hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        t0 = starts.pop(threading.get_ident(), time.perf_counter())
        size = len(kwargs.get("keys") or kwargs.get("transfers") or kwargs.get("page_hashes") or ())
        plugins = ",".join(i.plugin_name for i in impls)
        trace_log.info(
            "%s plugins=[%s] batch=%d op=%s pool=%s %.1fus%s",
            hook_name,
            plugins,
            size,
            kwargs.get("op", "-"),
            kwargs.get("pool_name", "-"),
            (time.perf_counter() - t0) * 1e6,
            f" error={outcome.exception!r}" if outcome.exception is not None else "",
        )

    return pm.add_hookcall_monitoring(before, after)
