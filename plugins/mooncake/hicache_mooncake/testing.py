"""Process fixtures for tests against the REAL Mooncake store.

* :class:`MooncakeMaster` starts ``mooncake_master`` on 127.0.0.1 with free ports (RPC,
  admin/metrics), a short lease TTL and a small client TTL, plus Mooncake's HTTP metadata
  server (:class:`MooncakeMetadataServer`) on 127.0.0.1; logs to files, waits until
  ``GET /health`` says ``"service_ready":true`` and stops the processes by PID. ``kill()`` and
  ``restart()`` (same ports) act on the master alone, for outage tests.
* Every listener these processes can bind to one address is bound to 127.0.0.1. The master's
  embedded HTTP metadata server cannot be (it ignores ``--http_metadata_server_host`` and binds
  every interface in 0.3.x), so it stays off and the separate server runs instead. What remains
  on every interface is the transfer engine of each Mooncake client (handshake RPC and TCP
  transport), which 0.3.x cannot pin (see ``Security`` in the README).
* :class:`MooncakeRealClient` starts the standalone ``mooncake_client`` (the master's HTTP
  metadata, its service on ``--host=127.0.0.1``, ``MC_TCP_BIND_ADDRESS=127.0.0.1`` so that it
  advertises loopback) that dummy clients (``setup_dummy``) attach to.
* pytest fixtures: ``mooncake_master`` (session), ``mooncake_standalone`` (session: its own
  master plus a real client), ``mooncake_master_factory`` (function-scoped, for outage tests).
  Use them with ``pytest_plugins = ["hicache_mooncake.testing"]`` in a ``conftest.py``.

This module is import-light: it imports neither torch nor ``mooncake`` at module level.
Every child process started from the main thread goes through a tiny launcher that asks the
kernel to SIGKILL it when the starting thread dies (``PR_SET_PDEATHSIG``), so a crashed test run
leaves nothing behind; orderly teardown uses SIGTERM, then SIGKILL after a bound, and an
``atexit`` hook stops whatever is still running.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "MooncakeMaster",
    "MooncakeMetadataServer",
    "MooncakeProcessError",
    "MooncakeRealClient",
    "MooncakeStandalone",
    "find_mooncake_binary",
    "free_ports",
    "mooncake_master",
    "mooncake_master_factory",
    "mooncake_standalone",
]

HOST = "127.0.0.1"

# Launcher: optionally set the parent-death signal, then exec the real binary (the PID is kept).
_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "if sys.argv[1] == 'pdeathsig':\n"
    "    try:\n"
    "        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"
    "    except Exception:\n"
    "        pass\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class MooncakeProcessError(RuntimeError):
    """A Mooncake process could not be found, started, or did not become ready in time."""


def find_mooncake_binary(name: str) -> str:
    """Path of the real ``mooncake_master`` / ``mooncake_client`` executable.

    Looks inside the installed ``mooncake`` package first (the console scripts only
    ``os.execv`` these), then next to the running interpreter, then on ``PATH``.
    """
    spec = importlib.util.find_spec("mooncake")  # does not execute the package
    for loc in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(loc) / name
        if cand.is_file():
            if not os.access(cand, os.X_OK):
                cand.chmod(cand.stat().st_mode | 0o111)
            return str(cand)
    for cand_s in (str(Path(sys.executable).parent / name), shutil.which(name)):
        if cand_s and os.path.isfile(cand_s) and os.access(cand_s, os.X_OK):
            return cand_s
    raise MooncakeProcessError(
        f"cannot find the {name!r} executable; install it with "
        "`pip install mooncake-transfer-engine-non-cuda` (and `apt-get install -y libibverbs1`)"
    )


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that are free on 127.0.0.1 right now."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Whether a TCP connect to ``host:port`` succeeds within ``timeout``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _tail(path: Path, nbytes: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"<no log: {exc}>"


def _segment_names(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if line.strip()}


def _close_idle_connections(address: str) -> None:
    """Close the plugin's idle shared Mooncake connections before their cluster goes away.

    Closing a connection whose master is gone takes ~6 s; doing it while the process still
    runs keeps interpreter exit fast. A no-op when the plugin was never used.
    """
    mod = sys.modules.get("hicache_mooncake._connection")
    if mod is not None:
        with contextlib.suppress(Exception):
            mod.close_idle_connections(address)


_LIVE: weakref.WeakSet[_Proc] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - exercised at interpreter exit
    for p in list(_LIVE):
        with contextlib.suppress(Exception):
            p.stop(timeout=3.0)


class _Proc:
    """A child process started by PID, logging to a file, stoppable with a bound."""

    name = "process"

    def __init__(self, log_dir: str | os.PathLike[str] | None) -> None:
        self._own_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="hicache-mc-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{self.name}.log"
        self._popen: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    # subclasses provide the command line, environment and readiness check
    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def address(self) -> str:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def log_tail(self, nbytes: int = 4000) -> str:
        return _tail(self.log_path, nbytes)

    def _spawn(self, ready_timeout: float) -> None:
        argv = self._argv()
        with self._lock:
            if self.running:
                raise MooncakeProcessError(f"{self.name} is already running (pid {self.pid})")
            log = open(self.log_path, "ab")
            try:
                log.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(argv)}\n".encode())
                log.flush()
                # PR_SET_PDEATHSIG fires when the starting THREAD exits: only use it from the main thread
                mode = "pdeathsig" if threading.current_thread() is threading.main_thread() else "plain"
                self._popen = subprocess.Popen(
                    [sys.executable, "-I", "-c", _LAUNCHER, mode, *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env(),
                    close_fds=True,
                )
            finally:
                log.close()
            _LIVE.add(self)
        deadline = time.monotonic() + ready_timeout
        while True:
            if not self.running:
                rc = self._popen.returncode if self._popen else None
                raise MooncakeProcessError(
                    f"{self.name} exited with code {rc} before becoming ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self._ready():
                return
            if time.monotonic() > deadline:
                self.stop(timeout=3.0)
                raise MooncakeProcessError(
                    f"{self.name} was not ready after {ready_timeout:.1f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL. Returns the exit code."""
        with self._lock:
            p = self._popen
            if p is None:
                return None
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                    p.wait(timeout=10.0)
            _LIVE.discard(self)
            return p.returncode

    def kill(self) -> None:
        """SIGKILL the process now and reap it (an abrupt outage)."""
        with self._lock:
            p = self._popen
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(timeout=10.0)
            _LIVE.discard(self)

    def close(self) -> None:
        _close_idle_connections(self.address)
        self.stop()
        self._remove_logs()

    def _remove_logs(self) -> None:
        if self._own_dir and os.environ.get("HICACHE_KEEP_SERVER_LOGS") != "1":
            shutil.rmtree(self.log_dir, ignore_errors=True)


class MooncakeMetadataServer(_Proc):
    """Mooncake's HTTP metadata server (``mooncake.http_metadata_server``) on ``127.0.0.1``.

    The master's embedded one (``--enable_http_metadata_server``) ignores
    ``--http_metadata_server_host`` and listens on every interface, so clusters that need HTTP
    metadata run this one, which binds the host it is given.
    """

    name = "mooncake_http_metadata_server"

    def __init__(
        self,
        port: int | None = None,
        *,
        ready_timeout: float = 20.0,
        log_dir: str | os.PathLike[str] | None = None,
        start: bool = True,
    ) -> None:
        super().__init__(log_dir)
        self.port = port if port is not None else free_ports(1)[0]
        self.ready_timeout = ready_timeout
        if start:
            self.start()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        """The ``metadata_server`` value for clients."""
        return f"http://{HOST}:{self.port}/metadata"

    def _argv(self) -> list[str]:
        return [sys.executable, "-m", "mooncake.http_metadata_server", "--host", HOST,
                "--port", str(self.port), "--log-level", "WARNING"]  # fmt: skip

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}?key=hicache-ready", timeout=0.5):
                return True
        except urllib.error.HTTPError:
            return True  # 404 for the absent key: the server answers
        except (OSError, urllib.error.URLError):
            return False

    def start(self) -> MooncakeMetadataServer:
        self._spawn(self.ready_timeout)
        return self


class MooncakeMaster(_Proc):
    """A ``mooncake_master`` on loopback with free ports, and its HTTP metadata server; a
    context manager.

    ``lease_ttl_ms`` is the object lease (``remove`` fails while it holds; 500 ms for tests),
    ``client_ttl_s`` how long a dead client's segment still receives placements. The metadata
    server (:attr:`metadata`) starts first and keeps running across :meth:`kill` and
    :meth:`restart` of the master, as a separately deployed one does; the master deletes the
    metadata of clients whose heartbeat timed out (``--enable_metadata_cleanup_on_timeout``).
    """

    name = "mooncake_master"

    def __init__(
        self,
        *,
        lease_ttl_ms: int = 500,
        client_ttl_s: int = 2,
        ready_timeout: float = 20.0,
        log_dir: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        start: bool = True,
    ) -> None:
        super().__init__(log_dir)
        self.binary = find_mooncake_binary("mooncake_master")
        self.rpc_port, self.http_port, self.admin_port = free_ports(3)
        self.metadata = MooncakeMetadataServer(self.http_port, log_dir=self.log_dir, start=False)
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.ready_timeout = ready_timeout
        self.extra_args = list(extra_args)
        if start:
            self.start()

    @property
    def address(self) -> str:
        """``host:port`` of the RPC service (``master_server_address``)."""
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """URL of the cluster's HTTP metadata server (``metadata_server`` for clients)."""
        return self.metadata.url

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port}"

    def _argv(self) -> list[str]:
        return [
            self.binary,
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            "--enable_metadata_cleanup_on_timeout=true",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.admin_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            f"--client_ttl={self.client_ttl_s}",
            "--logtostderr=1",
            *self.extra_args,
        ]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["MOONCAKE_TE_META_DATA_SERVER"] = self.metadata_server  # where the cleanup deletes
        return env

    def health(self, timeout: float = 0.5) -> dict[str, Any] | None:
        """The parsed ``/health`` document, or ``None`` when the admin server does not answer."""
        try:
            with urllib.request.urlopen(f"{self.admin_url}/health", timeout=timeout) as r:
                doc = json.loads(r.read().decode("utf-8", "replace") or "{}")
                return doc if isinstance(doc, dict) else None
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def _ready(self) -> bool:
        doc = self.health()
        return bool(doc and doc.get("service_ready") is True)

    def segments(self, timeout: float = 1.0) -> str:
        """The raw text of the admin ``/get_all_segments`` page (for readiness of clients)."""
        try:
            with urllib.request.urlopen(f"{self.admin_url}/get_all_segments", timeout=timeout) as r:
                return str(r.read().decode("utf-8", "replace"))
        except (OSError, urllib.error.URLError):
            return ""

    def start(self) -> MooncakeMaster:
        if not self.metadata.running:
            self.metadata.start()
        self._spawn(self.ready_timeout)
        return self

    def close(self) -> None:
        """Stop the master, then its metadata server; remove the logs unless kept."""
        try:
            _close_idle_connections(self.address)
            self.stop()
        finally:
            self.metadata.stop()
        self._remove_logs()

    def restart(self) -> MooncakeMaster:
        """Start the master again on the SAME ports (after :meth:`kill` or :meth:`stop`)."""
        if self.running:
            self.stop()
        return self.start()

    def __enter__(self) -> MooncakeMaster:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MooncakeMaster(address={self.address}, pid={self.pid}, running={self.running})"


class MooncakeRealClient(_Proc):
    """The standalone ``mooncake_client`` that dummy clients (``setup_dummy``) attach to.

    It uses the master's HTTP metadata server, serves dummy clients on ``127.0.0.1`` and
    advertises ``127.0.0.1`` for its transfer engine (whose two listeners Mooncake 0.3.x binds
    to every interface regardless). ``address`` is what ``setup_dummy`` (and the plugin's
    ``client_server_address``) needs.
    """

    name = "mooncake_client"

    def __init__(
        self,
        master: MooncakeMaster,
        *,
        global_segment_size: str = "512MB",
        local_buffer_size: str = "0",
        threads: int = 1,
        ready_timeout: float = 20.0,
        log_dir: str | os.PathLike[str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        start: bool = True,
    ) -> None:
        super().__init__(log_dir if log_dir is not None else master.log_dir)
        self._own_dir = False
        self.binary = find_mooncake_binary("mooncake_client")
        self.master = master
        (self.port,) = free_ports(1)
        self.global_segment_size = global_segment_size
        self.local_buffer_size = local_buffer_size
        self.threads = threads
        self.ready_timeout = ready_timeout
        self.extra_env = dict(extra_env or {})
        self._segments_before: set[str] = set()
        if start:
            self.start()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def _argv(self) -> list[str]:
        return [
            self.binary,
            f"--host={HOST}",
            f"--port={self.port}",
            f"--global_segment_size={self.global_segment_size}",
            f"--local_buffer_size={self.local_buffer_size}",
            f"--master_server_address={self.master.address}",
            f"--metadata_server={self.master.metadata_server}",
            "--protocol=tcp",
            f"--threads={self.threads}",
            "--logtostderr=1",
        ]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["MC_TCP_BIND_ADDRESS"] = HOST
        env.update(self.extra_env)
        return env

    def _ready(self) -> bool:
        # the service port is open AND the master lists a segment that was not there before
        if not port_open(HOST, self.port):
            return False
        return bool(_segment_names(self.master.segments()) - self._segments_before)

    def start(self) -> MooncakeRealClient:
        self._segments_before = _segment_names(self.master.segments())
        self._spawn(self.ready_timeout)
        return self

    def restart(self) -> MooncakeRealClient:
        if self.running:
            self.stop()
        return self.start()

    def __enter__(self) -> MooncakeRealClient:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MooncakeRealClient(address={self.address}, pid={self.pid}, running={self.running})"


class MooncakeStandalone:
    """A master plus one real client: the cluster that standalone (dummy) mode needs.

    ``options()`` returns plugin options for a dummy client of this cluster; processes that
    share it share data (the objects live in the real client's segment).
    """

    def __init__(
        self,
        *,
        global_segment_size: str = "512MB",
        log_dir: str | os.PathLike[str] | None = None,
        master_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.master = MooncakeMaster(log_dir=log_dir, **dict(master_kwargs or {}))
        try:
            self.client = MooncakeRealClient(self.master, global_segment_size=global_segment_size)
        except BaseException:
            self.master.close()
            raise

    @property
    def client_address(self) -> str:
        return self.client.address

    def options(self, **overrides: Any) -> dict[str, Any]:
        """Backend options (``hicache_mooncake`` names) for a dummy client of this cluster."""
        opts: dict[str, Any] = {
            "standalone_storage": True,
            "client_server_address": self.client.address,
            "master_server_address": self.master.address,
            "metadata_server": self.master.metadata_server,
        }
        opts.update(overrides)
        return opts

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.master.close()

    def __enter__(self) -> MooncakeStandalone:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------ pytest
try:  # pytest is optional: the classes above work without it
    import pytest
except ImportError:  # pragma: no cover
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def mooncake_master() -> Iterator[MooncakeMaster]:
        """One ``mooncake_master`` for the session (embedded / P2PHANDSHAKE clients)."""
        with MooncakeMaster() as m:
            yield m

    @pytest.fixture(scope="session")
    def mooncake_standalone() -> Iterator[MooncakeStandalone]:
        """A dedicated master plus a real ``mooncake_client`` (HTTP metadata) for dummy clients.

        Kept apart from ``mooncake_master``: mixing P2PHANDSHAKE and HTTP-metadata clients on
        one master breaks transfers.
        """
        with MooncakeStandalone() as s:
            yield s

    @pytest.fixture
    def mooncake_master_factory() -> Iterator[Any]:
        """``make(**kwargs) -> MooncakeMaster``: private masters, stopped after the test."""
        made: list[MooncakeMaster] = []

        def make(**kwargs: Any) -> MooncakeMaster:
            m = MooncakeMaster(**kwargs)
            made.append(m)
            return m

        yield make
        for m in made:
            m.close()
