"""The optional C extension ``hicache_core._batchops``: one-pass checks for the per-batch hot path.

Right after a batch has moved megabytes the CPU caches are cold, and each pass the interpreter
makes over a batch then costs tens of microseconds. The extension does in one pass what the
hot path's Python does in several: validate page hashes, copy and bound-check host indices,
build page keys, check a backend's flags, validate storage keys. Each function answers only the usual case and
returns ``None`` (``False`` for ``valid_hashes``) for anything else; the caller then runs its
own Python code, which is the reference for the answer and raises the typed errors.
``tests/core/test_batchops.py`` checks the two against each other.

``NATIVE`` is ``None`` when the extension is not built, or when ``HICACHE_PURE_PYTHON_BATCH=1``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Final, Protocol, cast

__all__ = ["NATIVE", "BatchOps", "load_extension"]


class BatchOps(Protocol):
    """The interface of the ``hicache_core._batchops`` C extension."""

    def valid_hashes(self, seq: object, /) -> bool:
        """An exact list/tuple of exact-``str`` valid page hashes (1-128 of ``[A-Za-z0-9_-]``,
        the first alphanumeric); ``False`` means "check in Python"."""

    def valid_keys(self, seq: object, /) -> bool:
        """An exact list/tuple of exact-``str`` valid storage keys (``check_key``'s rule);
        ``False`` means "check in Python"."""

    def index_tuple(self, seq: object, limit: int, /) -> tuple[int, ...] | None:
        """An exact list/tuple of exact ints in ``[0, limit)`` as a tuple (``seq`` if a tuple)."""

    def page_keys(self, prefixes: object, hashes: object, /) -> list[tuple[str, ...]] | None:
        """``[tuple(p + h for p in prefixes) for h in hashes]`` for a tuple of ASCII ``str``
        prefixes and a list or tuple of ASCII exact-``str`` hashes. A tuple subclass is read
        as a tuple, ignoring any ``__iter__`` of its own: pass only :class:`ValidHashes`."""

    def bool_flags(self, obj: object, n: int, /) -> list[bool] | None:
        """A copy of ``obj`` if it is an exact list of ``n`` exact bools."""


def load_extension(name: str, pure_python_env: str) -> ModuleType | None:
    """The core's optional C extension ``hicache_core.<name>``, or ``None`` when it is not built
    or the environment variable ``pure_python_env`` is set (to anything but ``0``)."""
    if os.environ.get(pure_python_env, "").strip() not in ("", "0"):
        return None
    try:
        return importlib.import_module(f"{__package__ or 'hicache_core'}.{name}")
    except ImportError:
        return None


NATIVE: Final = cast("BatchOps | None", load_extension("_batchops", "HICACHE_PURE_PYTHON_BATCH"))
