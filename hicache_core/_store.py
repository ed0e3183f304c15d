"""``Store``: one opened backend, its per-store plugin manager and checked hook callers."""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from operator import countOf
from typing import TYPE_CHECKING, Any

import pluggy
from pydantic import BaseModel, ValidationError

from . import hookspecs
from ._batch import NATIVE
from ._config import StorageConfig, format_validation_error
from ._errors import (
    BackendContractError,
    BackendIOError,
    BackendUnavailableError,
    BatchShapeError,
    HiCacheError,
    OperationNotSupportedError,
    OptionsError,
    PoolError,
)
from ._hookcall import PluginManager, hook_call
from ._keys import DefaultPageKeys, ValidHashes
from ._registry import availability, load_backend_class, load_extension_class
from ._types import Capabilities, DraftIo, HitPolicy, IoOp, PoolName, PoolTransfer

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ._pools import HostPool

__all__ = ["Store", "open_store", "validate_options"]

log = logging.getLogger("hicache")
TRACE_ENV = "HICACHE_TRACE"


# The hooks called per batch, with their hookspec arguments: bound through ``hook_call``.
_HOT_HOOKS = {
    name: tuple(inspect.signature(getattr(hookspecs, name)).parameters)
    for name in ("hicache_batch_io_v1", "hicache_batch_io_v2", "hicache_page_keys")
}
_SEQUENCES = (list, tuple, ValidHashes)  # sequences and never str/bytes: no ABC check needed


def _io_op(op: object) -> IoOp:
    try:
        return IoOp(op)
    except ValueError:
        raise BatchShapeError(f"unknown I/O op {op!r}; use one of {[o.value for o in IoOp]}") from None


def _pool_name(name: object) -> PoolName:
    try:
        return PoolName(name)
    except ValueError:
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
        self.pm = PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.keys = DefaultPageKeys(config)
        self.pm.register(self.keys, name="hicache-default-keys")
        try:
            self.backend = cls(config, self.options)
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
        self._undo_trace = (
            _enable_tracing(self.pm) if os.environ.get(TRACE_ENV, "") not in ("", "0") else None
        )
        self._resolve_hooks()

    def _resolve_hooks(self) -> None:
        """Bind the hot-path hooks for the manager's current registrations (see ``_hookcall``).

        Each bound hook takes its hookspec's arguments positionally. The generation is recorded
        last: a concurrent call that sees it finds every binding made.
        """
        generation = self.pm.generation
        self._hooks = {name: hook_call(self.pm, name, args) for name, args in _HOT_HOOKS.items()}
        keys_hook = self._hooks["hicache_page_keys"]
        # The default scheme called directly: it returns a tuple of keys per page.
        self._default_keys_hook = keys_hook if keys_hook == self.keys.hicache_page_keys else None
        self._hooks_generation = generation

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
        from ._pools import _check_region, torch_allocator

        mem = self.pm.hook.hicache_alloc_host_memory(nbytes=nbytes)
        if mem is None:
            return torch_allocator(nbytes)
        try:
            _check_region(mem, nbytes)
        except PoolError as err:
            raise BackendContractError(
                f"backend {self.name!r}: hicache_alloc_host_memory({nbytes}) returned unusable memory: {err}"
            ) from None
        return mem  # type: ignore[no-any-return]

    # -------------------------------------------------------------------- I/O
    def page_keys(self, pool_name: PoolName | str, page_hashes: Sequence[str]) -> list[tuple[str, ...]]:
        if type(page_hashes) not in _SEQUENCES and (
            isinstance(page_hashes, (str, bytes)) or not isinstance(page_hashes, Sequence)
        ):
            raise BatchShapeError(
                f"page_hashes must be a sequence of hash strings, got {type(page_hashes).__name__}"
            )
        if type(pool_name) is not PoolName:
            pool_name = _pool_name(pool_name)
        result = self._run_hook("hicache_page_keys", pool_name, page_hashes)
        if result is None or len(result) != len(page_hashes):
            raise self._keys_count_error(result, len(page_hashes))
        return result  # type: ignore[no-any-return]

    def _trusted_transfer(
        self, pool_name: PoolName, host_indices: tuple[int, ...], hashes: ValidHashes, policy: HitPolicy
    ) -> PoolTransfer:
        """``PoolTransfer(pool_name, host_indices, hashes, policy, keys=page_keys(pool_name, hashes))``.

        Without the argument checks, for the controller's one-batch path, which guarantees what
        they and ``PoolTransfer`` would establish: a registered ``PoolName``, a tuple of exact
        ``int`` host indices as long as ``hashes``, a ``HitPolicy``. The keys are checked like
        ``page_keys``'s and made a tuple per page.
        """
        if self.pm.generation != self._hooks_generation:  # _run_hook, inlined for the hot path
            self._resolve_hooks()
        try:
            result = self._hooks["hicache_page_keys"](pool_name, hashes)
        except HiCacheError:
            raise
        except Exception as err:
            raise self._hook_error("hicache_page_keys", err) from err
        if result is None or len(result) != len(hashes):
            raise self._keys_count_error(result, len(hashes))
        default = self._hooks["hicache_page_keys"] is self._default_keys_hook  # tuples already
        keys = tuple(result) if default else tuple(map(tuple, result))
        return PoolTransfer._trusted(pool_name, host_indices, hashes, policy, keys)

    def _keys_count_error(self, result: Any, n: int) -> BackendContractError:
        return BackendContractError(
            f"backend {self.name!r}: hicache_page_keys returned "
            f"{'None' if result is None else len(result)} entries for {n} pages"
        )

    def batch_io_v1(
        self, op: IoOp | str, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None = None
    ) -> list[bool]:
        if type(op) is not IoOp:
            op = _io_op(op)
        if op is IoOp.EXISTS:
            buffers = None
        elif buffers is None or len(buffers) != len(keys):
            raise BatchShapeError(
                f"batch_io_v1({op.value}): {len(keys)} keys but "
                f"{'no' if buffers is None else len(buffers)} buffers; pass one buffer per key"
            )
        if not self.capabilities.v1:
            raise OperationNotSupportedError(f"backend {self.name!r} does not implement v1 I/O")
        if not keys:
            return []
        result = self._run_hook("hicache_batch_io_v1", op, keys, buffers)
        return self._check_flags("hicache_batch_io_v1", result, len(keys))

    def batch_io_v2(self, op: IoOp | str, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        if type(op) is not IoOp:
            op = _io_op(op)
        if not self.capabilities.v2:
            raise OperationNotSupportedError(f"backend {self.name!r} does not implement v2 I/O")
        for t in transfers:
            if not isinstance(t, PoolTransfer):
                raise BatchShapeError(f"batch_io_v2 takes PoolTransfer objects, got {type(t).__name__}")
            if t.pool not in self.pools:
                self.pool(t.pool)  # raises PoolError
        if not transfers:
            return []
        return [
            self._check_flags("hicache_batch_io_v2", r, len(t))
            for r, t in zip(self._call_io_v2(op, transfers), transfers)
        ]

    def _transfer_v2(self, op: IoOp, transfer: PoolTransfer) -> list[bool]:
        """``batch_io_v2(op, [transfer])[0]`` as a new list, without the argument checks.

        For the controller's one-batch path, which guarantees what those checks establish:
        ``op`` is an :class:`IoOp`, ``transfer`` a :class:`PoolTransfer` of a registered pool,
        and the backend implements v2. The result is checked like ``batch_io_v2``'s.
        """
        if self.pm.generation != self._hooks_generation:  # _run_hook, inlined for the hot path
            self._resolve_hooks()
        try:
            result = self._hooks["hicache_batch_io_v2"](op, [transfer])
        except HiCacheError:
            raise
        except Exception as err:
            raise self._hook_error("hicache_batch_io_v2", err) from err
        if result is None or len(result) != 1:
            raise self._io_v2_count_error(result, 1)
        flags = result[0]
        n = len(transfer.page_hashes)
        if NATIVE is not None:
            copied = NATIVE.bool_flags(flags, n)
            if copied is not None:
                return copied  # never the backend's own list object
        if type(flags) is list and len(flags) == n and countOf(map(type, flags), bool) == n:
            return flags[:]  # never the backend's own list object
        return list(self._check_flags("hicache_batch_io_v2", flags, n))

    def _call_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> Any:
        """The ``hicache_batch_io_v2`` hook's result, checked to hold one entry per transfer."""
        result = self._run_hook("hicache_batch_io_v2", op, transfers)
        if result is None or len(result) != len(transfers):
            raise self._io_v2_count_error(result, len(transfers))
        return result

    def _io_v2_count_error(self, result: Any, n: int) -> BackendContractError:
        return BackendContractError(
            f"backend {self.name!r}: hicache_batch_io_v2 must return one list per transfer "
            f"({n}), got {'None' if result is None else len(result)}"
        )

    def _run_hook(self, name: str, *args: Any) -> Any:
        """Call a hot-path hook with its hookspec's arguments, positionally.

        Rebinds the hooks first when registrations or tracing changed since they were bound; a
        non-hicache exception from a plugin becomes a typed :class:`BackendIOError`.
        """
        if self.pm.generation != self._hooks_generation:
            self._resolve_hooks()
        try:
            return self._hooks[name](*args)
        except HiCacheError:
            raise
        except Exception as err:
            raise self._hook_error(name, err) from err

    def _hook_error(self, name: str, err: Exception) -> BackendIOError:
        return BackendIOError(f"backend {self.name!r}: {name} raised {type(err).__name__}: {err}")

    def _check_flags(self, hook: str, result: Any, n: int) -> list[bool]:
        if result is None or not isinstance(result, (list, tuple)):
            raise BackendContractError(
                f"backend {self.name!r}: {hook} returned None; it must return one bool per entry ({n})"
            )
        if len(result) != n or (n and countOf(map(type, result), bool) != n):
            raise BackendContractError(
                f"backend {self.name!r}: {hook} must return a list of exactly {n} bools, got "
                f"{len(result)} entries of types {sorted({type(x).__name__ for x in result})}"
            )
        return result if isinstance(result, list) else list(result)

    def draft_io(self) -> DraftIo:
        result = self.pm.hook.hicache_draft_io_capability()
        if not isinstance(result, DraftIo):
            raise BackendContractError(
                f"backend {self.name!r}: hicache_draft_io_capability must return a DraftIo, got {result!r}"
            )
        return result

    def clear(self) -> int:
        """Remove this config's namespace from storage; returns the number of objects removed."""
        if not self.pm.hook.hicache_clear.get_hookimpls():
            raise OperationNotSupportedError(f"backend {self.name!r} does not implement hicache_clear")
        removed = self.pm.hook.hicache_clear(namespace=self.keys.scheme.namespace)
        return int(removed or 0)

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
    if config is None:
        config = StorageConfig(**overrides)
    elif overrides:
        config = config.model_copy(update=overrides)
    return Store(config)


def _enable_tracing(pm: pluggy.PluginManager) -> Any:
    trace_log = logging.getLogger("hicache.trace")
    starts: dict[int, float] = {}

    def before(hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        starts[threading.get_ident()] = time.perf_counter()

    def after(outcome: Any, hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        t0 = starts.pop(threading.get_ident(), time.perf_counter())
        size = len(kwargs.get("keys") or kwargs.get("transfers") or kwargs.get("page_hashes") or ())
        plugins = ",".join(i.plugin_name for i in impls)
        trace_log.info(
            "%s plugins=[%s] batch=%d op=%s %.1fus%s",
            hook_name,
            plugins,
            size,
            kwargs.get("op", "-"),
            (time.perf_counter() - t0) * 1e6,
            f" error={outcome.exception!r}" if outcome.exception is not None else "",
        )

    return pm.add_hookcall_monitoring(before, after)
