"""``eic``, ``simm``: declared backends whose transports need a vendor SDK.

Each class states what the real integration can do (its :class:`~hicache_core.Capabilities`,
as SGLang's backend of the same name does it) so ``hicache backends`` can list it, and
reports through ``availability()`` that it cannot run here. The core refuses to open a backend
whose ``availability()`` gives a reason (:class:`~hicache_core.BackendUnavailableError`); the
constructor and every I/O hook raise the same error, so no code path stores or returns data.
The I/O hooks first check the keys they are given (:func:`hicache_core.check_keys`), so a
hostile key gets :class:`~hicache_core.KeyFormatError` here as from every built-in backend.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from hicache_core import (
    BackendUnavailableError,
    Capabilities,
    DraftIo,
    DraftIoMode,
    IoOp,
    KeyFormatError,
    PoolName,
    PoolTransfer,
    check_keys,
    hookimpl,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from hicache_core import HostPool

__all__ = ["EicBackend", "SimmBackend", "VendorSdkBackend"]

_DIST = "hicache-hf3fs-stub"


class VendorSdkBackend:
    """Base of the SDK-gated backends: subclasses only fill in the class attributes."""

    backend_name: ClassVar[str]
    """The entry-point name (``hicache.backends``) this class is published under."""
    sdk: ClassVar[str]
    """Human name of the vendor SDK."""
    sdk_module: ClassVar[str]
    """Top-level Python module of the SDK (probed with ``find_spec``, never imported)."""
    install: ClassVar[str]
    """How to install the SDK."""
    capabilities: ClassVar[Capabilities]

    class Options(BaseModel):
        """No options: the backend cannot be opened without its vendor SDK."""

        model_config = ConfigDict(extra="forbid", defer_build=True)

    @classmethod
    def sdk_installed(cls) -> bool:
        """Whether the SDK's module can be found (it is not imported)."""
        try:
            return importlib.util.find_spec(cls.sdk_module) is not None
        except (ImportError, ValueError):
            return False

    @classmethod
    def availability(cls) -> str:
        """Why this backend cannot run here (always a reason: this distribution has no transport)."""
        if not cls.sdk_installed():
            return f"needs the vendor SDK ({cls.sdk}; install {cls.install})"
        return (
            f"needs a transport for the vendor SDK ({cls.sdk}), which is installed, but {_DIST} only "
            f"declares {cls.backend_name!r}; install a full {cls.backend_name} hicache plugin"
        )

    @classmethod
    def draft_reason(cls) -> str:
        return (
            f"{cls.backend_name} stores target KV pages only: draft KV offload is not implemented for "
            f"the {cls.sdk} integration"
        )

    def __init__(self, config: Any, options: Any) -> None:
        self._refuse()

    @classmethod
    def _refuse(cls) -> None:
        raise BackendUnavailableError(f"backend {cls.backend_name!r} cannot run here: {cls.availability()}")

    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: HostPool) -> None:
        self._refuse()

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        """``unsupported``: draft KV is not offloaded by these integrations."""
        return DraftIo(DraftIoMode.UNSUPPORTED, self.draft_reason())

    @hookimpl
    def hicache_batch_io_v1(
        self,
        op: IoOp,
        keys: Sequence[str],
        buffers: Sequence[torch.Tensor] | None,
        pool_name: PoolName | None = None,  # unused (pluggy does not pass it): for direct calls
    ) -> list[bool]:
        _check_batch(keys)
        self._refuse()
        raise AssertionError  # pragma: no cover - _refuse always raises

    @hookimpl
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        for transfer in transfers:
            for page_keys in getattr(transfer, "keys", ()):
                _check_batch(page_keys)
        self._refuse()
        raise AssertionError  # pragma: no cover - _refuse always raises


def _check_batch(keys: object) -> None:
    """:func:`hicache_core.check_keys` on a batch that must be a sequence of keys, not one string."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Iterable):
        raise KeyFormatError(f"keys must be a sequence of str keys, got {type(keys).__name__}")
    check_keys(tuple(keys))


class EicBackend(VendorSdkBackend):
    """Volcano Engine EIC (Elastic Instant Cache): a distributed KV-cache service over RDMA."""

    backend_name = "eic"
    sdk = "Volcano Engine EIC client, Python module `eic`"
    sdk_module = "eic"
    install = "the EIC Python SDK from Volcano Engine (https://www.volcengine.com/docs/85848/1749188)"
    capabilities = Capabilities(
        v1=True,
        pools=frozenset({PoolName.KV}),
        persistent=True,
        shared=True,
        draft_io=DraftIoMode.UNSUPPORTED,
    )


class SimmBackend(VendorSdkBackend):
    """Scitix SiMM (In-Memory Middleware): a distributed memory pool over RDMA."""

    backend_name = "simm"
    sdk = "Scitix SiMM client, Python module `simm`"
    sdk_module = "simm"
    install = "SiMM from source (https://github.com/scitix/SiMM)"
    capabilities = Capabilities(
        v1=True,
        pools=frozenset({PoolName.KV}),
        persistent=True,
        shared=True,
        draft_io=DraftIoMode.UNSUPPORTED,
    )
