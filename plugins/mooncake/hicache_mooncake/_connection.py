"""``Connection``: one set-up ``MooncakeDistributedStore`` (bounded setup, registered memory,
health gate), shared by every store of a process opened with the same connection options.

Measured facts this module is built on (see the project's Mooncake reference):

* ``setup()`` retries for ~90 s when the master is missing (``MC_STORE_CLIENT_SETUP_RETRIES``
  attempts of ~4.4 s each), waits 30 s for an answer from a port that accepts but never answers,
  and holds the GIL all along, so it cannot be abandoned from a thread and freezes every other
  thread meanwhile. The bound is a pre-flight in plain Python sockets (GIL released) until
  ``setup_timeout_s``: the master (standalone: the mooncake_client) must answer a Mooncake RPC
  and an HTTP ``metadata_server`` must answer HTTP; only then ``setup()`` runs, with retries
  limited to one attempt.
* Mooncake 0.3.x binds each transfer engine's handshake RPC and TCP transport to every
  interface, with no option to pin them. After each setup the connection names those ports in
  one warning (:mod:`._listeners`): this process's in embedded mode, the mooncake_client's in
  standalone mode.
* While the master is down a call returns ``-900`` (RPC_FAIL), some immediately and later ones
  after ~4.4 s; a dead mooncake_client blocks the first dummy call ~8.6 s. The gate marks the
  connection down on such results (or when its monitor's TCP probe is refused) and then fails
  every batch after one probe (``probe_timeout_s``) until the endpoints answer again.
* ``close()`` takes 1-2 s (6 s with the master gone) and holds the GIL. Stores with identical
  connection options therefore share one connection (``reuse_connection``, like SGLang's reuse
  of the process-wide transfer engine); an idle shared connection is closed at interpreter exit
  or by :func:`close_idle_connections`.
* In standalone (dummy) mode only memory from ``alloc_from_mem_pool`` can be registered, with
  exactly the returned ``(ptr, size)``. Opening probes the ``mooncake_client`` (typed
  :class:`BackendTimeoutError` within ``setup_timeout_s``), but ``setup_dummy`` itself is
  deferred (:meth:`Connection.ensure_setup`) to the first ``hicache_alloc_host_memory(nbytes)``,
  which announces ``nbytes`` (``hicache_core.sizing.standalone_required_bytes`` of the planned
  pools) as ``mem_pool_size``. If I/O or a pool registration comes first (pools allocated
  outside the store), it connects then with the ``mem_pool_size`` option (0: ``local_buffer_size``).
  A shared connection is set up once: the size of its first setup (normally the first opener's
  pool allocation) applies to every store sharing it.
* Object checksums (CRC-64, ``MOONCAKE_STORE_CHECKSUM``) are read ONCE per process, when its
  first client is created, and apply to every client of the process; in standalone mode the
  ``mooncake_client`` process computes and verifies them, so only its environment counts.
  Objects stored without a checksum stay readable by verifying clients and vice versa.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import ctypes
import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache_core import BackendIOError, BackendTimeoutError, BackendUnavailableError

from ._inflight import InflightPuts
from ._listeners import Listener, find_listening_process, listeners, socket_inodes, warn_exposed
from ._options import CHECKSUM_ENV, INSTALL_HINT, MooncakeOptions, checksum_enabled, resolve_device
from ._probe import await_answer, http_probe, rpc_probe, split_address, tcp_probe

__all__ = [
    "Connection",
    "HealthGate",
    "acquire",
    "close_idle_connections",
    "import_store",
    "process_checksum",
    "tcp_probe",
]

log = logging.getLogger("hicache.mooncake")

SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
_ENV_LOCK = threading.Lock()
_SETUP_LOCK = threading.Lock()


def import_store() -> Any:
    """The ``mooncake.store`` module, or :class:`BackendUnavailableError` with an install hint."""
    try:
        import mooncake.store as store
    except ImportError as err:
        raise BackendUnavailableError(f"cannot import mooncake.store ({err}); {INSTALL_HINT}") from err
    return store


_process_checksum: bool | None = None  # fixed when this process creates its first embedded client


def _prepare_checksum(options: MooncakeOptions) -> None:
    """Before an embedded client is created: ask for object checksums if ``options.checksum``
    (unless ``MOONCAKE_STORE_CHECKSUM`` is already set) and record the process-wide setting
    Mooncake will read. Only the first call of a process has an effect."""
    global _process_checksum
    with _ENV_LOCK:
        if _process_checksum is not None:
            return
        if options.checksum:
            os.environ.setdefault(CHECKSUM_ENV, "1")
        _process_checksum = checksum_enabled(os.environ.get(CHECKSUM_ENV))
        if _process_checksum:
            log.info("hicache mooncake: object checksums (CRC-64) on for this process's Mooncake clients")


def process_checksum() -> bool | None:
    """Whether this process's embedded Mooncake clients verify object checksums (``None``: no
    embedded client created yet). A Mooncake client created outside this plugin before the
    first one of the plugin is not seen."""
    return _process_checksum


@contextlib.contextmanager
def _limited_setup_retries() -> Iterator[None]:
    """Limit the library's own setup retries to one attempt unless the operator chose a value."""
    with _ENV_LOCK:
        if SETUP_RETRIES_ENV in os.environ:
            yield
            return
        os.environ[SETUP_RETRIES_ENV] = "1"
        try:
            yield
        finally:
            os.environ.pop(SETUP_RETRIES_ENV, None)


@dataclass
class Region:
    """A registered memory range ``[start, end)`` and who uses it."""

    start: int
    end: int
    owners: set[str] = field(default_factory=set)
    holder: Any = None  # keeps the memory alive while the transport may touch it
    # Store-owned shared memory: never unregistered before close, never freed (Mooncake cannot);
    # its holder is a weak reference to the ctypes array the tensors handed out are built on.
    permanent: bool = False


class HealthGate:
    """Tracks whether the store's endpoints answer; fails calls fast during an outage.

    A call result whose codes are all connection failures marks the gate down; any answered
    code marks it up. While down, each call first probes the endpoints (``probe_timeout``)
    and the batch fails at once if one refuses. A monitor thread probes every ``interval``
    seconds so that a dead endpoint is noticed before a call blocks on it.
    """

    def __init__(self, endpoints: Sequence[str], probe_timeout: float, interval: float, name: str) -> None:
        self.endpoints = [e for e in endpoints if e]
        self.probe_timeout = probe_timeout
        self.name = name
        self.down_since: float | None = None
        self.reason = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval > 0 and self.endpoints:
            self._thread = threading.Thread(
                target=self._monitor, args=(interval,), name="hicache-mooncake-health", daemon=True
            )
            self._thread.start()

    def _probe(self) -> str | None:
        for ep in self.endpoints:
            why = tcp_probe(ep, self.probe_timeout)
            if why is not None:
                return f"{ep} unreachable ({why})"
        return None

    def _monitor(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if self.down_since is None:
                why = self._probe()
                if why is not None:
                    self.mark_down(why)

    def reachable(self) -> str | None:
        """``None`` if calls may proceed, else why not (only probes while marked down)."""
        if self.down_since is None:
            return None
        return self._probe()

    def mark_down(self, why: str) -> None:
        with self._lock:
            if self.down_since is None:
                self.down_since = time.monotonic()
                self.reason = why
                log.warning(
                    "hicache mooncake %s: unavailable (%s); batches fail fast while %s refuses connections",
                    self.name,
                    why,
                    " / ".join(self.endpoints) or "it",
                )

    def mark_up(self) -> None:
        if self.down_since is None:
            return
        with self._lock:
            if self.down_since is not None:
                log.warning(
                    "hicache mooncake %s: answering again after %.1f s",
                    self.name,
                    time.monotonic() - self.down_since,
                )
                self.down_since = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.probe_timeout + 1.0)


def _key(o: MooncakeOptions, tp_rank: int, ranks: int) -> tuple[Any, ...]:
    """Everything that reaches ``setup`` / ``setup_dummy`` or the gate: equal keys share a connection."""
    if o.standalone_storage:
        explicit = o.master_server_address if "master_server_address" in o.model_fields_set else ""
        return ("dummy", o.client_server_address, explicit, o.mem_pool_size, o.local_buffer_size,
                o.probe_timeout_s, o.health_probe_interval_s)  # fmt: skip
    return (
        "embedded",
        o.master_server_address,
        o.metadata_server,
        o.protocol,
        resolve_device(o.device_name, tp_rank),
        o.local_hostname,
        o.global_segment_size // max(1, ranks),
        o.local_buffer_size,
        o.tenant_id,
        o.enable_ssd_offload,
        o.ssd_offload_path,
        o.probe_timeout_s,
        o.health_probe_interval_s,
    )


class Connection:
    """A set-up Mooncake store (embedded ``setup`` or standalone ``setup_dummy``)."""

    def __init__(self, options: MooncakeOptions, *, tp_rank: int = 0, ranks: int = 1) -> None:
        self.options = options
        self.standalone = options.standalone_storage
        self.module = import_store()
        self.where = (
            f"mooncake_client {options.client_server_address}"
            if self.standalone
            else f"mooncake_master {options.master_server_address}"
        )
        self.setup_size: int | None = None
        """Standalone: the ``mem_pool_size`` passed to ``setup_dummy`` (``None`` until it ran)."""
        self.exposed: tuple[Listener, ...] = ()
        """The Mooncake listeners bound to every interface that this connection's setup found
        (embedded: this process's; standalone: the mooncake_client's)."""
        self._set_up = not self.standalone  # embedded stores are set up in _connect
        self._setup_lock = threading.Lock()
        self.store = self._connect(tp_rank, ranks)
        endpoints = [options.master_server_address]
        if self.standalone:  # the client always; the master too when it was given explicitly
            explicit = "master_server_address" in options.model_fields_set
            endpoints = [options.client_server_address or "", *(endpoints if explicit else [])]
        self.gate = HealthGate(
            endpoints, options.probe_timeout_s, options.health_probe_interval_s, self.where
        )
        self.key: tuple[Any, ...] | None = None
        self.users = 0
        self.closed = False
        self._regions: list[Region] = []
        self._starts: list[int] = []
        self._lock = threading.Lock()
        self.inflight = InflightPuts()
        """The keys this process is putting right now through this connection."""

    # ------------------------------------------------------------------ setup
    def _connect(self, tp_rank: int, ranks: int) -> Any:
        o = self.options
        t0 = time.monotonic()
        deadline = t0 + o.setup_timeout_s
        target = o.client_server_address if self.standalone else o.master_server_address
        assert target is not None
        if self.standalone:
            fix = (
                "start `mooncake_client --master_server_address=... --metadata_server=http://<master>/metadata` "
                "or fix client_server_address / MOONCAKE_CLIENT (the mooncake_client's --port)"
            )
        else:
            fix = "start `mooncake_master` or fix master_server_address / MOONCAKE_MASTER (the master's --rpc_port)"
        await_answer(self.where, target, rpc_probe, deadline, o.setup_timeout_s, fix)
        if not self.standalone and o.metadata_server.startswith(("http://", "https://")):
            fix = (
                "start the HTTP metadata server (`mooncake_http_metadata_server --host <ip> --port <port>`) "
                "or fix metadata_server / MOONCAKE_TE_META_DATA_SERVER"
            )
            what = f"metadata_server {o.metadata_server}"
            await_answer(what, o.metadata_server, http_probe, deadline, o.setup_timeout_s, fix)
        if o.check_server and not self.standalone:
            self._wait_health(deadline)
        if not self.standalone:
            _prepare_checksum(o)
        store = self.module.MooncakeDistributedStore()
        if self.standalone:  # setup_dummy waits for the pool sizes (ensure_setup)
            log.info(
                "hicache mooncake: %s reachable in %.3f s; setup_dummy deferred to the first pool "
                "allocation (sized by standalone_required_bytes)",
                self.where,
                time.monotonic() - t0,
            )
            return store
        kwargs: dict[str, Any] = {}
        if o.enable_ssd_offload:
            kwargs.update(enable_ssd_offload=True, ssd_offload_path=o.ssd_offload_path or "")
        if o.tenant_id != "default":
            kwargs["tenant_id"] = o.tenant_id
        with _SETUP_LOCK:  # one setup at a time, so the listeners it adds are its own
            before = socket_inodes()
            with _limited_setup_retries():
                rc = store.setup(
                    o.local_hostname,
                    o.metadata_server,
                    o.global_segment_size // max(1, ranks),
                    o.local_buffer_size,
                    o.protocol,
                    resolve_device(o.device_name, tp_rank),
                    o.master_server_address,
                    **kwargs,
                )
            self._check_rc(rc, "setup", t0)
            self.exposed = tuple(x for x in listeners() if x.wildcard and x.inode not in before)
        log.info("hicache mooncake: connected to %s in %.3f s", self.where, time.monotonic() - t0)
        warn_exposed(self.exposed, f"this process's Mooncake client (connected to {self.where})")
        return store

    def _check_rc(self, rc: int, call: str, t0: float) -> None:
        elapsed = time.monotonic() - t0
        if rc != 0:
            o = self.options
            cls = BackendTimeoutError if elapsed > o.setup_timeout_s else BackendIOError
            raise cls(
                f"mooncake: {call} against {self.where} returned {rc} after {elapsed:.1f} s; check that "
                f"the master is healthy, that metadata_server ({o.metadata_server!r}) matches the rest "
                "of the cluster, and the Mooncake log above"
            )

    @property
    def ready(self) -> bool:
        """Whether the store is set up (standalone: ``setup_dummy`` has run)."""
        return self._set_up

    def ensure_setup(self, nbytes: int | None = None) -> None:
        """Standalone: run the deferred ``setup_dummy`` once; a no-op when already set up.

        ``nbytes`` (from the first ``hicache_alloc_host_memory``: the pools'
        ``standalone_required_bytes``) becomes ``mem_pool_size``; without it (I/O or a pool
        registration before any allocation) the ``mem_pool_size`` option is used, or
        ``local_buffer_size`` when that is 0. Raises :class:`BackendIOError` if the
        ``mooncake_client`` refuses connections or ``setup_dummy`` fails.
        """
        if self._set_up:
            return
        with self._setup_lock:
            if self._set_up:
                return
            o = self.options
            assert o.client_server_address is not None
            if nbytes is not None and nbytes > 0:
                size, source = nbytes, "standalone_required_bytes of the planned pools"
            elif o.mem_pool_size:
                size, source = o.mem_pool_size, "mem_pool_size option (pools not allocated through the store)"
            else:
                size, source = o.local_buffer_size, "local_buffer_size (mem_pool_size=0; pools not allocated through the store)"  # fmt: skip
            fail = rpc_probe(o.client_server_address, o.setup_timeout_s)
            if fail is not None:
                cls = BackendTimeoutError if fail.kind == "silent" else BackendIOError
                raise cls(
                    f"mooncake: {self.where} did not answer ({fail.why}; setup_timeout_s="
                    f"{o.setup_timeout_s:g} s); setup_dummy not attempted. Check that the mooncake_client "
                    "runs and that client_server_address / MOONCAKE_CLIENT names its --port"
                )
            t0 = time.monotonic()
            with _limited_setup_retries():
                rc = self.store.setup_dummy(size, o.local_buffer_size, o.client_server_address)
            self._check_rc(rc, "setup_dummy", t0)
            self.setup_size = size
            self._set_up = True
            self._warn_client_listeners()
            log.info(
                "hicache mooncake: setup_dummy against %s with mem_pool_size=%d B (%s) in %.3f s",
                self.where,
                size,
                source,
                time.monotonic() - t0,
            )

    def _warn_client_listeners(self) -> None:
        """Standalone: name the mooncake_client's listeners that accept any interface (it holds
        the data and the registered shared memory of this process)."""
        address = self.options.client_server_address
        assert address is not None
        pid = find_listening_process(split_address(address)[1])
        if pid is None:
            log.warning(
                "hicache mooncake: the mooncake_client at %s is not visible from this process, so its "
                "listeners cannot be checked; Mooncake 0.3.x binds its transfer engine (handshake RPC "
                "and TCP transport) to every interface (README of hicache-mooncake, 'Security')",
                address,
            )
            return
        self.exposed = tuple(x for x in listeners(pid) if x.wildcard)
        warn_exposed(self.exposed, f"the mooncake_client at {address} (pid {pid})")

    def _wait_health(self, deadline: float) -> None:
        import urllib.request  # only standalone start-up needs it; its ssl import costs ~15 ms

        host, _ = split_address(self.options.master_server_address)
        url = f"http://{host}:{self.options.master_metrics_port}/health"
        last = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=self.options.probe_timeout_s) as r:
                    last = r.read().decode("utf-8", "replace")
                    if '"service_ready":true' in last.replace(" ", ""):
                        return
            except OSError as err:
                last = str(err)
            time.sleep(0.1)
        raise BackendTimeoutError(
            f"mooncake: master health {url} not ready within setup_timeout_s={self.options.setup_timeout_s:g} s "
            f"(last answer: {last[:200]!r}); check master_metrics_port or disable check_server"
        )

    # ------------------------------------------------------------- memory
    def _find(self, ptr: int, size: int) -> Region | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            r = self._regions[i]
            if ptr >= r.start and ptr + size <= r.end:
                return r
        return None

    def covers(self, ptr: int, size: int) -> bool:
        """Whether ``[ptr, ptr+size)`` lies inside one registered region."""
        return self._find(ptr, size) is not None

    def _insert(self, region: Region) -> None:
        i = bisect.bisect_left(self._starts, region.start)
        self._starts.insert(i, region.start)
        self._regions.insert(i, region)

    def _remove(self, region: Region) -> None:
        i = self._regions.index(region)
        del self._regions[i]
        del self._starts[i]
        if not region.permanent:
            self.store.unregister_buffer(region.start)

    def register(self, ptr: int, size: int, owner: str, holder: Any) -> bool:
        """Make ``[ptr, ptr+size)`` usable for zero-copy; ``False`` if the store refuses it.

        A range inside an already registered region just gains an owner. In standalone mode
        only shared memory from :meth:`alloc_shared` qualifies, so other memory returns False.
        """
        if size <= 0:
            return True
        self.ensure_setup()
        with self._lock:
            r = self._find(ptr, size)
            if r is not None:
                r.owners.add(owner)
                return True
            if self.standalone:
                return False
            # drop registrations that overlap but nobody uses any more
            for old in [x for x in self._regions if x.start < ptr + size and ptr < x.end]:
                if old.permanent or old.owners:
                    return False
                self._remove(old)
            rc = self.store.register_buffer(ptr, size)
            if rc != 0:
                log.warning("hicache mooncake: register_buffer(%#x, %d) returned %s", ptr, size, rc)
                return False
            self._insert(Region(ptr, ptr + size, {owner}, holder))
            return True

    def release(self, owner_prefix: str) -> None:
        """Drop every owner starting with ``owner_prefix``; unregister regions left unused."""
        with self._lock:
            for r in list(self._regions):
                r.owners = {o for o in r.owners if not o.startswith(owner_prefix)}
                if not r.owners and not r.permanent:
                    self._remove(r)

    def alloc_shared(self, nbytes: int, owner: str, *, sizes_mapping: bool = False) -> Any:
        """``nbytes`` of store-owned shared memory (standalone mode) as a flat uint8 tensor.

        With ``sizes_mapping`` (pool allocation) a still deferred ``setup_dummy`` announces
        ``nbytes`` as ``mem_pool_size``; otherwise it uses the option fallback.
        """
        import torch

        if not self.standalone:
            raise BackendIOError("mooncake: store-owned shared memory exists only in standalone mode")
        self.ensure_setup(nbytes if sizes_mapping else None)
        # Mooncake has no call that frees this memory, so a region no tensor uses any more (its
        # ctypes array was collected) is handed out again rather than allocating anew: a process
        # that opens and closes stores on one connection does not grow. A closed store's tensors
        # may wait in reference cycles, so one collection runs before new memory is taken.
        for attempt in range(2):
            if attempt:
                gc.collect()
            with self._lock:
                for r in self._regions:
                    if r.permanent and r.end - r.start == nbytes and r.holder() is None:
                        array = (ctypes.c_uint8 * nbytes).from_address(r.start)
                        r.holder, r.owners = weakref.ref(array), {owner}
                        return torch.frombuffer(array, dtype=torch.uint8)
                if not any(r.permanent and r.end - r.start == nbytes for r in self._regions):
                    break  # nothing of this size to wait for
        ptr = int(self.store.alloc_from_mem_pool(nbytes))
        if ptr <= 0:
            raise BackendIOError(
                f"mooncake: alloc_from_mem_pool({nbytes}) failed ({ptr}); the {self.where} could not "
                "provide shared memory (check its logs and the host's free memory)"
            )
        rc = self.store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise BackendIOError(f"mooncake: register_buffer of shared memory {nbytes} B returned {rc}")
        array = (ctypes.c_uint8 * nbytes).from_address(ptr)
        tensor = torch.frombuffer(array, dtype=torch.uint8)
        with self._lock:  # held weakly: the tensors' storage keeps the array alive while used
            self._insert(Region(ptr, ptr + nbytes, {owner}, weakref.ref(array), permanent=True))
        return tensor

    def close(self) -> None:
        """Unregister, then close the Mooncake client (1-2 s; store-owned shared memory stays mapped)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.gate.close()
            for r in self._regions:
                if not r.permanent:
                    with contextlib.suppress(Exception):
                        self.store.unregister_buffer(r.start)
            self._regions = [r for r in self._regions if r.permanent]
            self._starts = [r.start for r in self._regions]
        if not self._set_up:
            return  # standalone store never set up: nothing to close
        with contextlib.suppress(Exception):
            self.store.close()


_POOL: dict[tuple[Any, ...], Connection] = {}
_POOL_LOCK = threading.Lock()


def acquire(options: MooncakeOptions, tp_rank: int, ranks: int) -> Connection:
    """A connection for ``options``: the process-wide shared one when ``reuse_connection``."""
    if not options.reuse_connection:
        conn = Connection(options, tp_rank=tp_rank, ranks=ranks)
        conn.users = 1
        return conn
    key = _key(options, tp_rank, ranks)
    with _POOL_LOCK:
        shared = _POOL.get(key)
        if shared is None or shared.closed:
            shared = Connection(options, tp_rank=tp_rank, ranks=ranks)
            shared.key = key
            _POOL[key] = shared
        shared.users += 1
        return shared


def release(conn: Connection) -> None:
    """One user is done: a private connection closes now, a shared one stays for reuse."""
    with _POOL_LOCK:
        conn.users = max(0, conn.users - 1)
        if conn.key is not None and _POOL.get(conn.key) is conn:
            return
    if conn.users == 0:
        conn.close()


def close_idle_connections(address: str | None = None) -> int:
    """Close shared connections no store uses any more; returns how many were closed.

    With ``address`` (``host:port`` of a master or mooncake_client) only connections to it.
    """
    with _POOL_LOCK:
        idle = [c for c in _POOL.values() if c.users == 0 and (address is None or address in (c.key or ()))]
        for c in idle:
            assert c.key is not None
            del _POOL[c.key]
    for c in idle:
        c.close()
    return len(idle)


@atexit.register
def _close_all() -> None:  # pragma: no cover - runs at interpreter exit
    with _POOL_LOCK:
        conns = list(_POOL.values())
        _POOL.clear()
    for c in conns:
        with contextlib.suppress(Exception):
            c.close()
