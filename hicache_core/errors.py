"""The hicache error hierarchy.

Every error raised by hicache derives from :class:`HiCacheError`. Each leaf also
subclasses the builtin exception a caller would naturally catch (``LookupError``,
``ValueError``, ...), so code that does not know hicache still handles it sensibly.
Messages say what went wrong *and* how to fix it.

Every public constructor and call checks its arguments up front: a wrong type raises
:class:`ArgumentTypeError` (a ``TypeError``) or, where a more specific class already covers the
argument, that class or its type twin (:class:`KeyTypeError` for page hashes and keys,
:class:`BatchTypeError` for host indices and token ids: each is both the specific ``ValueError``
subclass and an ``ArgumentTypeError``), ``PoolError`` for pools, ``BackendContractError`` for
what a backend declares; a wrong value raises the specific ``ValueError`` subclass. Either way the message names the argument, and no
bare ``TypeError``/``AttributeError`` or pydantic ``ValidationError`` comes out of hicache.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "BackendContractError",
    "BackendIOError",
    "BackendNotFoundError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "BatchShapeError",
    "BatchTypeError",
    "ClosedError",
    "ConfigError",
    "HiCacheError",
    "KeyFormatError",
    "KeyTypeError",
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


class BackendContractError(HiCacheError, TypeError, ValueError):
    """A backend class, one of its hook results or what it declares (``Capabilities``, ``DraftIo``)
    breaks the hicache plugin contract.

    Both a ``TypeError`` (a wrong kind of object) and a ``ValueError`` (a wrong value, such as
    ``Capabilities(v1=False, v2=False)``, which raised a plain ``ValueError`` before).
    """


class ArgumentTypeError(HiCacheError, TypeError):
    """An argument of a public constructor or call has the wrong type; the message names it.

    For example ``HostPoolGroup(kv, extras=[...])`` (extras must be a mapping) or
    ``CacheController.backup(..., extra=[1])``.
    """


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


class KeyTypeError(KeyFormatError, ArgumentTypeError):
    """A page hash or storage key, or the batch holding them, has the wrong type (an int, bytes,
    ``None``, a lone str where a sequence is expected): a ``KeyFormatError`` that is also an
    ``ArgumentTypeError``, so ``except TypeError`` and ``except ValueError`` both catch it."""


class BatchTypeError(BatchShapeError, ArgumentTypeError):
    """A batch argument (host page indices, token ids, a page size) has the wrong type or dtype:
    a ``BatchShapeError`` that is also an ``ArgumentTypeError`` (a ``TypeError``)."""


class BackendIOError(HiCacheError, OSError):
    """A storage operation failed in the backend (reported per page by the controller)."""


class BackendTimeoutError(BackendIOError, TimeoutError):
    """A backend call did not complete within the configured I/O timeout."""


class OperationNotSupportedError(HiCacheError, NotImplementedError):
    """The backend does not implement an optional operation (for example ``clear``)."""


class ClosedError(HiCacheError, ValueError):
    """An operation on a controller or store after ``close()`` (like I/O on a closed file)."""
