"""``StoreLink``: one connected ``MooncakeDistributedStore`` with bounded setup, registered
memory regions, chunked batch calls and a health gate for outages.

Measured facts this module is built on (see the project's mooncake reference):

* ``setup()`` retries for ~90 s when the master is missing (``MC_STORE_CLIENT_SETUP_RETRIES``
  attempts of ~4.4 s each) and holds the GIL, so it cannot be abandoned from a thread. The
  bound is a TCP pre-flight probe of the master (or of the mooncake_client in standalone mode)
  until ``setup_timeout_s``, then ``setup()`` with retries limited to 1.
* While the master is down a call returns ``-900`` (RPC_FAIL), some immediately and later ones
  after ~4.4 s. After the first ``-900`` the gate probes the endpoint (``probe_timeout_s``)
  before each call and fails the whole batch at once while it is unreachable.
* Calls are chunked to ``max_keys_per_call`` (<= 2048): larger TCP batches hit lane-queue
  rejections and a 60 s transfer timeout.
* In standalone (dummy) mode only memory from ``alloc_from_mem_pool`` can be registered, with
  exactly the returned ``(ptr, size)``.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache_core import BackendIOError, BackendTimeoutError, BackendUnavailableError

from ._options import MooncakeOptions, resolve_device

__all__ = ["OBJECT_NOT_FOUND", "RPC_FAIL", "StoreLink", "import_store"]

log = logging.getLogger("hicache.mooncake")

RPC_FAIL = -900
OBJECT_NOT_FOUND = -704
# codes meaning "the service did not answer": RPC_FAIL, and -1 (batch_is_exist in dummy mode)
DOWN_CODES = frozenset({RPC_FAIL, -1})
SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
_ENV_LOCK = threading.Lock()

INSTALL_HINT = (
    "install the Mooncake store with `pip install mooncake-transfer-engine-non-cuda` (CPU hosts) or "
    "`pip install mooncake-transfer-engine` (CUDA hosts); it needs the system library libibverbs "
    "(`apt-get install -y libibverbs1`)"
)


def import_store() -> Any:
    """The ``mooncake.store`` module, or :class:`BackendUnavailableError` with an install hint."""
    try:
        import mooncake.store as store
    except ImportError as err:
        raise BackendUnavailableError(f"cannot import mooncake.store ({err}); {INSTALL_HINT}") from err
    return store


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def tcp_probe(address: str, timeout: float) -> str | None:
    """``None`` when ``host:port`` accepts a TCP connection within ``timeout``, else the reason."""
    host, port = _split(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as err:
        return err.strerror or type(err).__name__


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
    permanent: bool = False  # store-owned shared memory: never unregistered before close


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


class StoreLink:
    """A connected Mooncake store (embedded ``setup`` or standalone ``setup_dummy``)."""

    def __init__(self, options: MooncakeOptions, *, tp_rank: int = 0, ranks: int = 1) -> None:
        self.options = options
        self.standalone = options.standalone_storage
        mod = import_store()
        self._cfg = mod.ReplicateConfig()
        self._cfg.replica_num = options.replica_num
        self.where = (
            f"mooncake_client {options.client_server_address}"
            if self.standalone
            else f"mooncake_master {options.master_server_address}"
        )
        self.store = self._connect(mod, tp_rank, ranks)
        endpoints = [options.master_server_address]
        if self.standalone:  # the client always; the master too when it was given explicitly
            explicit = "master_server_address" in options.model_fields_set
            endpoints = [options.client_server_address or "", *(endpoints if explicit else [])]
        self.gate = HealthGate(
            endpoints, options.probe_timeout_s, options.health_probe_interval_s, self.where
        )
        self._regions: list[Region] = []
        self._starts: list[int] = []
        self._reg_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ setup
    def _connect(self, mod: Any, tp_rank: int, ranks: int) -> Any:
        o = self.options
        t0 = time.monotonic()
        deadline = t0 + o.setup_timeout_s
        target = o.client_server_address if self.standalone else o.master_server_address
        assert target is not None
        why = tcp_probe(target, min(o.probe_timeout_s, o.setup_timeout_s))
        while why is not None:
            if time.monotonic() + 0.1 >= deadline:
                hint = (
                    "start `mooncake_client --master_server_address=... --metadata_server=http://<master>/metadata` "
                    "or fix client_server_address / MOONCAKE_CLIENT"
                    if self.standalone
                    else "start `mooncake_master` or fix master_server_address / MOONCAKE_MASTER"
                )
                raise BackendTimeoutError(
                    f"mooncake: {self.where} is not reachable ({why}) within setup_timeout_s="
                    f"{o.setup_timeout_s:g} s; {hint}"
                )
            time.sleep(0.1)
            why = tcp_probe(target, max(0.05, min(o.probe_timeout_s, deadline - time.monotonic())))
        if o.check_server and not self.standalone:
            self._wait_health(deadline)
        store = mod.MooncakeDistributedStore()
        with _limited_setup_retries():
            if self.standalone:
                assert o.client_server_address is not None
                rc = store.setup_dummy(
                    o.mem_pool_size or o.local_buffer_size, o.local_buffer_size, o.client_server_address
                )
            else:
                kwargs: dict[str, Any] = {}
                if o.enable_ssd_offload:
                    kwargs.update(enable_ssd_offload=True, ssd_offload_path=o.ssd_offload_path or "")
                if o.tenant_id != "default":
                    kwargs["tenant_id"] = o.tenant_id
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
        elapsed = time.monotonic() - t0
        if rc != 0:
            cls = BackendTimeoutError if elapsed > o.setup_timeout_s else BackendIOError
            raise cls(
                f"mooncake: {'setup_dummy' if self.standalone else 'setup'} against {self.where} returned "
                f"{rc} after {elapsed:.1f} s; check that the master is healthy, that metadata_server "
                f"({o.metadata_server!r}) matches the rest of the cluster, and the Mooncake log above"
            )
        log.info("hicache mooncake: connected to %s in %.3f s", self.where, elapsed)
        return store

    def _wait_health(self, deadline: float) -> None:
        host, _ = _split(self.options.master_server_address)
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

    def register(self, ptr: int, size: int, owner: str, holder: Any) -> bool:
        """Make ``[ptr, ptr+size)`` usable for zero-copy; ``False`` if the store refuses it.

        A range inside an already registered region just gains an owner. In standalone mode
        only shared memory from :meth:`alloc_shared` qualifies, so other memory returns False.
        """
        if size <= 0:
            return True
        with self._reg_lock:
            r = self._find(ptr, size)
            if r is not None:
                r.owners.add(owner)
                return True
            if self.standalone:
                return False
            # drop stale registrations that overlap (memory freed by an earlier pool)
            for old in [x for x in self._regions if x.start < ptr + size and ptr < x.end]:
                if old.permanent:
                    return False
                self._remove(old)
            rc = self.store.register_buffer(ptr, size)
            if rc != 0:
                log.warning("hicache mooncake: register_buffer(%#x, %d) returned %s", ptr, size, rc)
                return False
            self._insert(Region(ptr, ptr + size, {owner}, holder))
            return True

    def _remove(self, region: Region) -> None:
        i = self._regions.index(region)
        del self._regions[i]
        del self._starts[i]
        if not region.permanent:
            self.store.unregister_buffer(region.start)

    def release(self, owner: str) -> None:
        """Forget ``owner``'s use of regions; unregister the ones nobody uses any more."""
        with self._reg_lock:
            for r in list(self._regions):
                r.owners.discard(owner)
                if not r.owners and not r.permanent:
                    self._remove(r)

    def alloc_shared(self, nbytes: int, owner: str) -> Any:
        """``nbytes`` of store-owned (shared in standalone mode) memory as a flat uint8 tensor."""
        import torch

        if not self.standalone:
            raise BackendIOError("mooncake: alloc_shared is only needed in standalone mode")
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
        with self._reg_lock:
            self._insert(Region(ptr, ptr + nbytes, {owner}, (array, tensor), permanent=True))
        return tensor

    # ------------------------------------------------------------ batch calls
    def _run(
        self, n: int, call: Callable[[int, int], Sequence[int]], what: str
    ) -> tuple[list[int], str | None]:
        """Run ``call(start, stop)`` over chunks of at most ``max_keys_per_call`` keys.

        Returns the per-key codes (``RPC_FAIL`` for keys never sent) and an outage reason when
        the store was unreachable.
        """
        codes = [RPC_FAIL] * n
        if n == 0:
            return codes, None
        why = self.gate.reachable()
        if why is not None:
            return codes, why
        step = self.options.max_keys_per_call
        for start in range(0, n, step):
            stop = min(n, start + step)
            part = call(start, stop)
            if len(part) != stop - start:
                raise BackendIOError(f"mooncake: {what} returned {len(part)} results for {stop - start} keys")
            codes[start:stop] = part
            if all(c in DOWN_CODES for c in part):
                why = f"{what} failed with {sorted(set(part))}"
                self.gate.mark_down(why)
                return codes, why
        self.gate.mark_up()
        return codes, None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        codes, _ = self._run(len(keys), lambda a, b: self.store.batch_is_exist(keys[a:b]), "batch_is_exist")
        return [c == 1 for c in codes]

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Publish each ``(ptr, size)`` under its key. With ``overwrite`` existing keys are replaced."""
        keys, ptrs, sizes = list(keys), list(ptrs), list(sizes)
        fn = self.store.batch_upsert_from if self.options.overwrite else self.store.batch_put_from
        codes, _ = self._run(len(keys), lambda a, b: fn(keys[a:b], ptrs[a:b], sizes[a:b], self._cfg), "put")
        return [c == 0 for c in codes]

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Read each object into ``(ptr, size)``; True only when exactly ``size`` bytes arrived."""
        keys, ptrs, sizes = list(keys), list(ptrs), list(sizes)
        codes, _ = self._run(
            len(keys),
            lambda a, b: self.store.batch_get_into(keys[a:b], ptrs[a:b], sizes[a:b]),
            "batch_get_into",
        )
        return [c == s for c, s in zip(codes, sizes)]

    def put_ranges(
        self, keys: Sequence[str], ptrs: Sequence[list[int]], sizes: Sequence[list[int]]
    ) -> list[bool]:
        """Publish objects assembled from several ranges each (strided page views)."""
        keys = list(keys)
        fn = self.store.batch_put_from_multi_buffers
        codes, _ = self._run(
            len(keys), lambda a, b: fn(keys[a:b], list(ptrs[a:b]), list(sizes[a:b]), self._cfg), "put"
        )
        return [c == 0 for c in codes]

    def get_ranges(
        self, keys: Sequence[str], ptrs: Sequence[list[int]], sizes: Sequence[list[int]]
    ) -> list[bool]:
        keys = list(keys)
        fn = self.store.batch_get_into_multi_buffers
        codes, _ = self._run(len(keys), lambda a, b: fn(keys[a:b], list(ptrs[a:b]), list(sizes[a:b])), "get")
        return [c == sum(s) for c, s in zip(codes, sizes)]

    def remove_prefix(self, prefix: str) -> int:
        """Remove (force) every object whose key starts with ``prefix``; returns the count."""
        import re

        why = self.gate.reachable()
        if why is not None:
            raise BackendIOError(f"mooncake: cannot clear, {why}")
        n = int(self.store.remove_by_regex("^" + re.escape(prefix), True))
        if n < 0:
            raise BackendIOError(f"mooncake: remove_by_regex failed with {n} on {self.where}")
        return n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.gate.close()
        with self._reg_lock:
            for r in self._regions:
                if not r.permanent:
                    with contextlib.suppress(Exception):
                        self.store.unregister_buffer(r.start)
            # store-owned shared memory stays mapped: pools carved from it may outlive the store
            self._regions = [r for r in self._regions if r.permanent]
            self._starts = [r.start for r in self._regions]
        with contextlib.suppress(Exception):
            self.store.close()
