"""The transfer path: request plans, batch I/O through the store, results, and the controller.

:class:`TransferPath` is the one place where pages move. :class:`CacheController` and the engine
adapters (``integrations/``) translate their requests into a :class:`Request` and
:class:`Plan` s and call it, on the I/O path :func:`select_io_path` chooses.
"""

from __future__ import annotations

from .calls import CallPool
from .controller import CacheController, DraftOffloadDisabledWarning
from .path import IoPath, Request, TransferPath, select_io_path
from .plan import Plan
from .prefetch import PrefetchHandle
from .results import QueryResult, TransferResult

__all__ = [
    "CacheController",
    "CallPool",
    "DraftOffloadDisabledWarning",
    "IoPath",
    "Plan",
    "PrefetchHandle",
    "QueryResult",
    "Request",
    "TransferPath",
    "TransferResult",
    "select_io_path",
]
