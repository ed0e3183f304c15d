"""Errors of the file backend (leaves of the hicache error tree)."""

from __future__ import annotations

from hicache_core import BackendIOError

__all__ = ["FileRootError"]


class FileRootError(BackendIOError):
    """``options.root`` cannot be used: not creatable, not a directory, not writable, or it
    holds another on-disk format. Raised when the store is opened; the message names the
    path and the fix. Also an ``OSError`` (through :class:`hicache_core.BackendIOError`)."""
