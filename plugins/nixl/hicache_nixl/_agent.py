"""The NIXL agent of one store: loading NIXL, creating the plugin, registering, moving bytes.

NIXL ships as per-CUDA wheels (``nixl-cu12``, ``nixl-cu13``) behind the ``nixl`` meta-package.
``nixl_cu12`` is preferred: its OBJ plugin loads on a host without CUDA, while ``nixl_cu13``'s
needs ``libcuobjclient.so.1``, which no wheel ships. The agent runs without a listener thread
(no socket is opened) and without a progress thread (transfers are polled by the caller).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import os
import threading
import time
import uuid
from types import ModuleType
from typing import Any

from hicache_core import BackendIOError, BackendUnavailableError, OptionsError

__all__ = ["INSTALL_HINT", "MODULES", "Agent", "Hold", "availability", "check_engine", "load_api", "obj_ids"]

log = logging.getLogger("hicache.nixl")

MODULES = ("nixl_cu12", "nixl")  # import order: the first one present is used
INSTALL_HINT = "install the plugin with its NIXL dependency: `pip install hicache-nixl`"

_POLL_S = 20e-6


def availability() -> str | None:
    """``None`` when a NIXL module is installed (found, not imported), else the reason."""
    for name in MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return None
        except (ImportError, ValueError):
            continue
    return f"cannot import NIXL (none of the modules {', '.join(MODULES)} is installed); {INSTALL_HINT}"


def load_api() -> ModuleType:
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``, ...)."""
    errors = []
    for name in MODULES:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as err:
            errors.append(f"{name}: {err}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NIXL configures its "nixl" logger at INFO onto stdout (one line per agent and plugin
            # created), which would mix with `hicache ... --json` output; NIXL_LOG_LEVEL overrides.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise BackendUnavailableError(f"cannot import NIXL ({'; '.join(errors)}); {INSTALL_HINT}")


_ids = itertools.count(1)  # OBJ device ids: unique per process (NIXL maps them to object names)
_ids_lock = threading.Lock()


def obj_ids(n: int) -> range:
    with _ids_lock:
        first = next(_ids)
        for _ in range(n - 1):
            next(_ids)
    return range(first, first + n)


_KEPT: list[Agent] = []  # agents NIXL may still be using (see Agent.close)


class Hold:
    """What one transfer uses (buffers, fds); ``abandoned`` once it was given up while running."""

    __slots__ = ("abandoned", "objects")

    def __init__(self, *objects: object) -> None:
        self.objects = list(objects)
        self.abandoned = False


class Agent:
    """One NIXL agent with one storage plugin (``POSIX`` or ``OBJ``) created in it."""

    def __init__(self, timeout_s: float) -> None:
        self.api = load_api()
        self.plugin = ""
        self.timeout_s = timeout_s
        self.name = f"hicache-nixl-{uuid.uuid4().hex[:12]}"
        sync = self.api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW  # hooks run on several threads
        conf = self.api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[], sync_mode=sync
        )
        self.agent = self.api.nixl_agent(self.name, conf)
        self.abandoned: list[object] = []  # buffers of timed-out transfers (see ``transfer``)
        self._pending: list[Any] = []  # transfer handles NIXL could not abort when abandoned
        self._lock = threading.Lock()
        self.shared = False  # a process-wide agent (obj): close() leaves it running
        # first address of each registered DRAM region -> registrations starting there: a
        # transfer descriptor must lie in one region, so runs are never merged across these
        self.bounds: dict[int, int] = {}
        # id(registration handle) -> (the handle, kept so its id is not reused; its region starts)
        self._starts: dict[int, tuple[Any, list[int]]] = {}

    def close(self) -> None:
        """Wait (at most ``max(30, 2 * timeout_s)`` s) for abandoned transfers to end,
        so the agent is not destroyed under a running request (which aborts the process); one
        still busy after that is kept for the process's lifetime, with a warning."""
        if self.shared:
            return
        deadline = time.monotonic() + max(30.0, 2 * self.timeout_s)
        with self._lock:
            pending = list(self._pending)
        busy = 0
        for handle in pending:  # wait for each to end (done or failed), then release it
            try:
                while self.agent.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline:
                    time.sleep(0.01)
                handle.release()
            except Exception:
                busy += 1
        if busy:
            import ctypes  # this rare path only: listing backends does not import ctypes

            _KEPT.append(self)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.agent))  # never finalized, even at exit
            log.warning(
                "hicache nixl: %d abandoned NIXL request(s) did not end within the close bound; the agent "
                "is kept until the process exits",
                busy,
            )

    def create(self, plugin: str, params: dict[str, str]) -> None:
        """Create ``plugin`` in this agent; every transfer uses it. ``params`` are never shown."""
        plugins = self.agent.get_plugin_list()
        if plugin not in plugins:
            raise BackendUnavailableError(
                f"NIXL ({self.api.__name__.split('.')[0]}) has no {plugin} plugin here (plugins: "
                f"{', '.join(plugins)}); {INSTALL_HINT}"
            )
        try:
            self.agent.create_backend(plugin, params)
        except Exception as err:  # the message never carries params (credentials)
            raise BackendIOError(
                f"NIXL could not create its {plugin} plugin ({type(err).__name__}: {err}); check the "
                "options (and for obj the endpoint, bucket and credentials)"
            ) from None
        self.plugin = plugin

    def plugin_params(self, plugin: str) -> dict[str, str]:
        """The init parameters a plugin accepts (names and defaults), without creating it."""
        return dict(self.agent.get_plugin_params(plugin))

    # --------------------------------------------------------------- registration
    def register(self, items: list[tuple[int, int, int, str]], mem: str) -> Any:
        """Register ``(addr, len, dev_id, meta)`` regions of memory type ``mem``; returns the handle."""
        try:
            descs = self.agent.get_reg_descs(items, mem)
            handle = self.agent.register_memory(descs, mem, [self.plugin])
        except Exception as err:
            raise BackendIOError(
                f"NIXL could not register {len(items)} {mem} regions: {type(err).__name__}: {err}"
            ) from None
        if mem == "DRAM":
            starts = [it[0] for it in items]
            with self._lock:
                self._starts[id(handle)] = (handle, starts)
                for a in starts:
                    self.bounds[a] = self.bounds.get(a, 0) + 1
        return handle

    def deregister(self, handle: Any) -> None:
        try:
            self.agent.deregister_memory(handle, [self.plugin])
        except Exception as err:  # nothing to recover; the regions die with the agent
            log.debug("hicache nixl: deregister failed: %s", err)
        with self._lock:
            for a in self._starts.pop(id(handle), (None, ()))[1]:
                if self.bounds[a] <= 1:
                    del self.bounds[a]
                else:
                    self.bounds[a] -= 1

    # ------------------------------------------------------------------ transfers
    def transfer(
        self,
        op: str,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        mem: str,
        keep: Hold | None = None,
    ) -> bool:
        """Move ``local`` (DRAM) <-> ``remote`` (``mem``) descriptors pairwise; ``True`` when done.

        ``op`` is ``"WRITE"`` (DRAM to storage) or ``"READ"``. A transfer NIXL reports failed,
        or (``mem`` other than ``"FILE"``) one still running after ``timeout_s``, is ``False``
        (logged); it is released either way. A ``"FILE"`` transfer moves the caller's pool memory,
        so past ``timeout_s`` it is waited for (logged), never abandoned.
        A transfer abandoned while running may still touch its memory and files: ``keep`` (what
        the caller allocated or opened for it) is then marked abandoned and kept for the agent's
        lifetime, so no buffer is freed and no fd closed (and reused) under NIXL.
        """
        if not local:
            return True
        agent = self.agent
        try:
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, mem),
                self.name,
                b"",
                [self.plugin],
            )
        except Exception as err:
            log.warning(
                "hicache nixl: %s transfer of %d regions refused: %s: %s",
                op,
                len(local),
                type(err).__name__,
                err,
            )
            return False
        try:
            state = agent.transfer(handle)
            if state == "PROC":
                deadline = time.monotonic() + self.timeout_s
                spins = 0
                while state == "PROC":
                    spins += 1
                    if spins > 64:
                        time.sleep(_POLL_S)
                        if time.monotonic() > deadline and mem == "FILE":
                            # posix regions are the caller's pool memory: abandoning the transfer
                            # would let NIXL write it after the hook returned. Wait for the end
                            # (local disk I/O completes); the store's io_timeout_s bounds a call.
                            log.warning(
                                "hicache nixl: %s transfer of %d regions still running after %.1f s; "
                                "waiting for it to end (it uses host pool memory)",
                                op,
                                len(local),
                                self.timeout_s,
                            )
                            deadline = float("inf")
                        elif time.monotonic() > deadline:
                            log.warning(
                                "hicache nixl: %s transfer of %d regions timed out after %.1f s",
                                op,
                                len(local),
                                self.timeout_s,
                            )
                            if keep is not None:
                                keep.abandoned = True
                            self.abandoned.append(keep)
                            return False
                    state = agent.check_xfer_state(handle)
            if state != "DONE":
                log.warning("hicache nixl: %s transfer of %d regions failed (%s)", op, len(local), state)
                return False
            return True
        except Exception as err:
            log.warning(
                "hicache nixl: %s transfer of %d regions failed: %s: %s",
                op,
                len(local),
                type(err).__name__,
                err,
            )
            return False
        finally:
            try:
                handle.release()
            except Exception as err:  # not abortable now: close() waits for it to end
                log.warning("hicache nixl: a %s transfer could not be released yet: %s", op, err)
                with self._lock:
                    self._pending.append(handle)


def check_engine(agent_params: dict[str, str], engine: str) -> str:
    """The POSIX init parameter of ``engine``; ``OptionsError`` when this NIXL does not offer it."""
    key = {"aio": "use_aio", "uring": "use_uring"}[engine]
    if key not in agent_params:
        offered = sorted(k.removeprefix("use_") for k in agent_params if k.startswith("use_"))
        raise OptionsError(
            f"invalid options for backend 'nixl': engine={engine!r} is not offered by this NIXL's POSIX "
            f"plugin (it offers: {', '.join(offered) or 'none'}); set options.engine to one of those"
        )
    return key
