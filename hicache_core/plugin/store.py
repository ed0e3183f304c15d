"""``Store``: one opened backend in its own pluggy ``PluginManager``, with checked hook calls."""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Sequence
from operator import countOf
from typing import TYPE_CHECKING, Any

import pluggy
from pydantic import BaseModel, ValidationError

from .. import hookspecs
from ..config import StorageConfig, format_validation_error
from ..env import env_flag
from ..errors import (
    ArgumentTypeError,
    BackendContractError,
    BackendIOError,
    BackendUnavailableError,
    BatchShapeError,
    BatchTypeError,
    ClosedError,
    HiCacheError,
    OperationNotSupportedError,
    OptionsError,
    PoolError,
)
from ..paging import ValidHashes
from ..types import Capabilities, DraftIo, IoOp, PageKeys, PoolName, PoolTransfer
from .default_keys import DefaultPageKeys
from .protocol import Backend
from .registry import availability, load_backend_class, load_extension_class
from .trace import enable_tracing

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..pools import HostPool

__all__ = ["Store", "open_store", "validate_options"]

log = logging.getLogger("hicache")
_EXISTS = IoOp.EXISTS  # an enum member lookup costs a Python call (Python 3.11)


def _io_op(op: object) -> IoOp:
    try:
        return IoOp(op)
    except (ValueError, TypeError):
        raise BatchShapeError(f"unknown I/O op {op!r}; use one of {[o.value for o in IoOp]}") from None


def _pool_name(name: object) -> PoolName:
    try:
        return PoolName(name)
    except (ValueError, TypeError):
        raise PoolError(f"unknown pool name {name!r}; known pools: {[p.value for p in PoolName]}") from None


def validate_options(backend_cls: type, name: str, options: Any) -> BaseModel:
    """Validate ``options`` with ``backend_cls.Options``; errors name the backend and field path."""
    model: type[BaseModel] = backend_cls.Options  # type: ignore[attr-defined]
    if isinstance(options, model):
        return options
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise OptionsError(
            f"options for backend {name!r} must be a JSON object / mapping, got {type(options).__name__}"
        )
    try:
        return model.model_validate(options)
    except ValidationError as err:
        fields = ", ".join(sorted(model.model_fields)) or "(none)"
        raise OptionsError(
            f"invalid options for backend {name!r}:\n{format_validation_error(err, 'options.')}\n"
            f"Fields accepted by {name!r}: {fields}"
        ) from None


class Store:
    """An opened backend.

    The backend instance (built as ``cls(config, options)``), the core's default key scheme
    and the enabled extensions are registered in one :class:`pluggy.PluginManager` per store.
    Hook results are checked here, so callers never see ``None`` or a wrong-length list.
    """

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.name = config.backend
        cls = load_backend_class(config.backend)
        reason = availability(cls)
        if reason is not None:
            raise BackendUnavailableError(f"backend {self.name!r} cannot run here: {reason}")
        self.backend_class = cls
        self.capabilities: Capabilities = cls.capabilities  # type: ignore[attr-defined]
        self.options = validate_options(cls, self.name, config.options)
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.keys = DefaultPageKeys(config)
        self.pm.register(self.keys, name="hicache-default-keys")
        try:
            self.backend: Backend = cls(config, self.options)
        except HiCacheError:
            raise
        except Exception as err:
            raise BackendIOError(
                f"backend {self.name!r} failed to open: {type(err).__name__}: {err}"
            ) from err
        self.extensions: dict[str, object] = {}
        try:
            self._register(self.backend, f"backend:{self.name}")
            self.capabilities = self._instance_capabilities()  # after registering: a refusal closes it
            for ext_name in dict.fromkeys(config.extensions):
                ext = load_extension_class(ext_name)(config)
                self._register(ext, f"extension:{ext_name}")
                self.extensions[ext_name] = ext
                bind = getattr(ext, "bind_store", None)
                if callable(bind):
                    bind(self)  # lets an extension read backend-level counters
        except BaseException:
            self.pm.hook.hicache_close()  # release what the backend opened
            raise
        self.pools: dict[PoolName, HostPool] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._undo_trace = enable_tracing(self.pm) if env_flag("HICACHE_TRACE") else None
        hook = self.pm.hook
        self._page_keys_hook = hook.hicache_page_keys
        self._io_v1_hook = hook.hicache_batch_io_v1
        self._io_v2_hook = hook.hicache_batch_io_v2

    def _instance_capabilities(self) -> Capabilities:
        """The opened backend's capabilities: its class's, or an instance's narrower per-options copy."""
        caps = getattr(self.backend, "capabilities", self.capabilities)
        if not isinstance(caps, Capabilities):
            raise BackendContractError(
                f"backend {self.name!r}: instance attribute `capabilities` must be a hicache_core.Capabilities, "
                f"got {type(caps).__name__}"
            )
        cls_caps = self.capabilities
        widened = [f for f in ("v1", "v2", "zero_copy") if getattr(caps, f) and not getattr(cls_caps, f)] + (
            ["pools"] if not caps.pools <= cls_caps.pools else []
        )
        if widened:
            raise BackendContractError(
                f"backend {self.name!r}: an instance may only narrow its class's capabilities, but it "
                f"adds {widened}; declare them on the class"
            )
        return caps

    def _register(self, plugin: object, name: str) -> None:
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as err:
            raise BackendContractError(f"{name} breaks the hicache hook contract: {err}") from None

    # ------------------------------------------------------------------ pools
    def register_pool(self, pool_name: PoolName | str, pool: HostPool) -> None:
        name = _pool_name(pool_name)
        if self._closed:
            raise self._closed_error()
        if name not in self.capabilities.pools:
            raise PoolError(
                f"backend {self.name!r} does not support pool {name.value!r}; it declares "
                f"{sorted(p.value for p in self.capabilities.pools)}. Choose a backend that does."
            )
        self.pm.hook.hicache_register_pool(pool_name=name, pool=pool)
        self.pools[name] = pool

    def pool(self, pool_name: PoolName | str) -> HostPool:
        try:
            return self.pools[PoolName(pool_name)]
        except (KeyError, ValueError):
            raise PoolError(
                f"pool {str(pool_name)!r} is not registered with store {self.name!r}; registered: "
                f"{[p.value for p in self.pools]}"
            ) from None

    def alloc_host_memory(self, nbytes: int) -> torch.Tensor:
        """Memory for pools: the backend's (``hicache_alloc_host_memory``) or plain torch."""
        from ..pools import check_region, torch_allocator

        mem = self.pm.hook.hicache_alloc_host_memory(nbytes=nbytes)
        if mem is None:
            return torch_allocator(nbytes)
        try:
            check_region(mem, nbytes)
        except PoolError as err:
            raise BackendContractError(
                f"backend {self.name!r}: hicache_alloc_host_memory({nbytes}) returned unusable memory: {err}"
            ) from None
        return mem  # type: ignore[no-any-return]

    # -------------------------------------------------------------------- I/O
    def page_keys(self, pool_name: PoolName | str, page_hashes: Sequence[str]) -> PageKeys:
        """The component keys of each page (``hicache_page_keys``), one tuple per page hash."""
        if type(page_hashes) is not ValidHashes and (
            isinstance(page_hashes, (str, bytes)) or not isinstance(page_hashes, Sequence)
        ):
            raise BatchTypeError(
                f"page_hashes must be a sequence of hash strings, got {type(page_hashes).__name__}"
            )
        name = pool_name if type(pool_name) is PoolName else _pool_name(pool_name)
        try:
            result = self._page_keys_hook(pool_name=name, page_hashes=page_hashes)
        except HiCacheError:
            raise
        except Exception as err:
            raise self._plugin_error("hicache_page_keys", err) from err
        if not isinstance(result, (list, tuple)) or len(result) != len(page_hashes):
            raise BackendContractError(
                f"backend {self.name!r}: hicache_page_keys returned "
                f"{'None' if result is None else len(result)} entries for {len(page_hashes)} pages"
            )
        try:
            return PageKeys(result)  # our own tuple of tuples, never the hook's list
        except HiCacheError as err:
            raise BackendContractError(
                f"backend {self.name!r}: hicache_page_keys must return one tuple of keys per page: {err}"
            ) from None

    def batch_io_v1(
        self,
        op: IoOp | str,
        keys: Sequence[str],
        buffers: Sequence[torch.Tensor] | None = None,
        pool_name: PoolName | str = PoolName.KV,
    ) -> list[bool]:
        """``hicache_batch_io_v1``: one bool per key. ``pool_name`` names the pool the buffers
        (and keys) belong to."""
        if type(op) is not IoOp:
            op = _io_op(op)
        name = pool_name if type(pool_name) is PoolName else _pool_name(pool_name)
        if isinstance(keys, (str, bytes)):
            raise ArgumentTypeError(
                f"batch_io_v1: keys must be a sequence of key strings, got one {type(keys).__name__}; "
                "wrap a single key in a list"
            )
        if op is _EXISTS:
            buffers = None
        elif buffers is None or len(buffers) != len(keys):
            raise BatchShapeError(
                f"batch_io_v1({op.value}): {len(keys)} keys but "
                f"{'no' if buffers is None else len(buffers)} buffers; pass one buffer per key"
            )
        if not self.capabilities.v1:
            raise OperationNotSupportedError(f"backend {self.name!r} does not implement v1 I/O")
        if self._closed:
            raise self._closed_error()
        if not keys:
            return []
        try:
            result = self._io_v1_hook(op=op, keys=keys, buffers=buffers, pool_name=name)
        except HiCacheError:
            raise
        except Exception as err:
            # Checked only now (the happy path pays nothing): a buffer that is not a tensor is
            # the caller's mistake, not the plugin's.
            _check_buffers(buffers)
            raise self._plugin_error("hicache_batch_io_v1", err) from err
        return self._check_flags("hicache_batch_io_v1", result, len(keys))

    def batch_io_v2(self, op: IoOp | str, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        """``hicache_batch_io_v2``: per transfer, one bool per page."""
        if type(op) is not IoOp:
            op = _io_op(op)
        if not self.capabilities.v2:
            raise OperationNotSupportedError(f"backend {self.name!r} does not implement v2 I/O")
        for t in transfers:
            if not isinstance(t, PoolTransfer):
                raise BatchTypeError(f"batch_io_v2 takes PoolTransfer objects, got {type(t).__name__}")
            if t.pool not in self.pools:
                self.pool(t.pool)  # raises PoolError
        if self._closed:
            raise self._closed_error()
        if not transfers:
            return []
        try:
            result = self._io_v2_hook(op=op, transfers=transfers)
        except HiCacheError:
            raise
        except Exception as err:
            raise self._plugin_error("hicache_batch_io_v2", err) from err
        if not isinstance(result, (list, tuple)) or len(result) != len(transfers):
            raise BackendContractError(
                f"backend {self.name!r}: hicache_batch_io_v2 must return one list per transfer "
                f"({len(transfers)}), got {'None' if result is None else len(result)}"
            )
        out = []
        for r, t in zip(result, transfers):
            n = len(t.page_hashes)
            if type(r) is list and len(r) == n and countOf(map(type, r), bool) == n:
                out.append(r.copy())  # a list of our own, never the backend's object
            else:
                out.append(self._check_flags("hicache_batch_io_v2", r, n))
        return out

    def _call(self, hook: pluggy.HookCaller, name: str, **kwargs: Any) -> Any:
        """Call a hook; a non-hicache exception from a plugin becomes a :class:`BackendIOError`."""
        try:
            return hook(**kwargs)
        except HiCacheError:
            raise
        except Exception as err:
            raise self._plugin_error(name, err) from err

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"store {self.name!r} is closed; open a new one (hicache_core.open_store)")

    def _plugin_error(self, hook: str, err: Exception) -> BackendIOError:
        """The :class:`BackendIOError` for a non-hicache exception ``err`` raised by a plugin's hook."""
        return BackendIOError(f"backend {self.name!r}: {hook} raised {type(err).__name__}: {err}")

    def _check_flags(self, hook: str, result: Any, n: int) -> list[bool]:
        if result is None or not isinstance(result, (list, tuple)):
            got = "None (a missing return statement?)" if result is None else f"a {type(result).__name__}"
            raise BackendContractError(
                f"backend {self.name!r}: {hook} returned {got}; it must return a list of one bool per "
                f"entry ({n})"
            )
        if len(result) != n or countOf(map(type, result), bool) != n:
            raise BackendContractError(
                f"backend {self.name!r}: {hook} must return a list of exactly {n} bools, got "
                f"{len(result)} entries of types {sorted({_type_name(x) for x in result})} (convert "
                "numpy or torch results with bool(x))"
            )
        return list(result)  # a list of our own, never the backend's object

    def draft_io(self) -> DraftIo:
        result = self.pm.hook.hicache_draft_io_capability()
        if not isinstance(result, DraftIo):
            raise BackendContractError(
                f"backend {self.name!r}: hicache_draft_io_capability must return a DraftIo, got {result!r}"
            )
        return result

    def clear(self) -> int:
        """Remove this config's namespace from storage; returns the number of objects removed.

        The backend's ``hicache_clear`` receives the bare namespace (``self.keys.scheme.namespace``,
        no trailing ``.``) and must remove every object whose key starts with ``namespace + "."``
        (keys are ``{namespace}.{pool}.{component}.{ranks}.{hash}``), so a namespace that is a
        string prefix of another one never clears it. A result that is not a non-negative int
        (``None`` included) is a :class:`BackendContractError`.
        """
        if not self.pm.hook.hicache_clear.get_hookimpls():
            raise OperationNotSupportedError(f"backend {self.name!r} does not implement hicache_clear")
        if self._closed:
            raise self._closed_error()
        removed = self._call(
            self.pm.hook.hicache_clear, "hicache_clear", namespace=self.keys.scheme.namespace
        )
        try:
            count = -1 if isinstance(removed, bool) else operator.index(removed)
        except TypeError:
            count = -1
        if count < 0:
            got = "None (a missing return statement?)" if removed is None else repr(removed)
            raise BackendContractError(
                f"backend {self.name!r}: hicache_clear returned {got}; it must return the number of "
                "objects it removed, an int >= 0 (0 when the namespace held nothing)"
            )
        return count

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.pm.hook.hicache_close()
        finally:
            if self._undo_trace is not None:
                self._undo_trace()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store(backend={self.name!r}, pools={[p.value for p in self.pools]})"


def open_store(config: StorageConfig | None = None, **overrides: Any) -> Store:
    """Open the configured backend: ``open_store(StorageConfig(backend="file", options={...}))``."""
    if config is not None and not isinstance(config, StorageConfig):
        raise ArgumentTypeError(
            f"config must be a hicache_core.StorageConfig or None, got {type(config).__name__}"
        )
    if config is None:
        config = StorageConfig(**overrides)
    elif overrides:
        config = config.model_copy(update=overrides)
    return Store(config)


def _check_buffers(buffers: Sequence[Any] | None) -> None:
    """Raise :class:`ArgumentTypeError` naming the first buffer that is not a ``torch.Tensor``."""
    import torch

    for i, buf in enumerate(buffers or ()):
        if not isinstance(buf, torch.Tensor):
            raise ArgumentTypeError(
                f"batch_io_v1: buffers[{i}] is a {type(buf).__name__}, not a torch.Tensor; pass one "
                "uint8 CPU tensor view per key (e.g. HostPool.page_views)"
            )


def _type_name(x: object) -> str:
    """``bool``, ``int``, ... for builtins; ``numpy.bool`` (whose ``__name__`` is ``bool``) qualified."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
