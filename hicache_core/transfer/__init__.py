"""The transfer path: request plans, batch I/O through the store, results, and the controller."""

from .controller import CacheController, DraftOffloadDisabledWarning
from .prefetch import PrefetchHandle
from .results import QueryResult, TransferResult

__all__ = [
    "CacheController",
    "DraftOffloadDisabledWarning",
    "PrefetchHandle",
    "QueryResult",
    "TransferResult",
]
