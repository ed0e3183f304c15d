"""The hicache error hierarchy.

Every error raised by hicache derives from :class:`HiCacheError`. Each leaf also
subclasses the builtin exception a caller would naturally catch (``LookupError``,
``ValueError``, ...), so code that does not know hicache still handles it sensibly.
Messages say what went wrong *and* how to fix it.
"""

from __future__ import annotations

__all__ = [
    "BackendContractError",
    "BackendIOError",
    "BackendNotFoundError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "BatchShapeError",
    "ConfigError",
    "HiCacheError",
    "KeyFormatError",
    "OperationNotSupportedError",
    "OptionsError",
    "PoolError",
]


class HiCacheError(Exception):
    """Base class of every error raised by hicache."""


class BackendNotFoundError(HiCacheError, LookupError):
    """No installed (or allowed) backend has the requested name."""


class BackendUnavailableError(HiCacheError, ImportError):
    """The backend is installed but cannot run here (missing dependency or vendor SDK)."""


class BackendContractError(HiCacheError, TypeError):
    """A backend class or one of its hook results breaks the hicache plugin contract."""


class OptionsError(HiCacheError, ValueError):
    """Backend options failed validation against the backend's ``Options`` model."""


class ConfigError(HiCacheError, ValueError):
    """A :class:`~hicache_core.StorageConfig` (or its file / environment source) is invalid."""


class PoolError(HiCacheError, ValueError):
    """A host pool is missing, unregistered, unallocated or has an unsuitable layout."""


class KeyFormatError(HiCacheError, ValueError):
    """A page hash or storage key is malformed or unsafe (separators, ``..``, NUL, too long)."""


class BatchShapeError(HiCacheError, ValueError):
    """Batch arguments disagree: mismatched lengths, wrong buffer size, dtype or device."""


class BackendIOError(HiCacheError, OSError):
    """A storage operation failed in the backend (reported per page by the controller)."""


class BackendTimeoutError(BackendIOError, TimeoutError):
    """A backend call did not complete within the configured I/O timeout."""


class OperationNotSupportedError(HiCacheError, NotImplementedError):
    """The backend does not implement an optional operation (for example ``clear``)."""
