"""Setup against an endpoint that accepts connections but never answers (a hung master, another
service on that port): opening fails within ``setup_timeout_s`` + 1 s with a typed error naming
the address, the option and the fix, and the other Python threads of the process keep running
meanwhile (Mooncake's ``setup()`` holds the GIL while it waits 30 s for such a port).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hicache_mooncake.testing import MooncakeMaster, MooncakeStandalone
from mooncake_helpers import embedded_options, make_config, make_group

from hicache_core import BackendTimeoutError, CacheController, open_store

SETUP_TIMEOUT_S = 2.0
BOUND_S = SETUP_TIMEOUT_S + 1.0
MAX_STALL_S = 0.5  # the longest a 10 ms ticker thread may go without running


class Endpoint:
    """A loopback port that forwards every connection to ``forward_to`` until :meth:`silence`,
    and afterwards (or without ``forward_to``) accepts connections and never answers."""

    def __init__(self, forward_to: str | None = None) -> None:
        self.forward_to = forward_to
        self._srv = socket.create_server(("127.0.0.1", 0), backlog=64)
        self._srv.settimeout(0.2)
        self.address = f"127.0.0.1:{self._srv.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def silence(self) -> None:
        self.forward_to = None

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self._srv.accept()[0]
            except OSError:
                continue
            self._held.append(conn)
            target = self.forward_to
            if target is None:
                continue
            host, port = target.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            self._held.append(upstream)
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in [*self._held, self._srv]:
            s.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)


@pytest.fixture
def silent() -> Iterator[str]:
    """``host:port`` of a loopback socket that accepts every connection and never answers."""
    endpoint = Endpoint()
    yield endpoint.address
    endpoint.close()


@contextlib.contextmanager
def ticking() -> Iterator[list[float]]:
    """A thread that notes the time every 10 ms; yields the longest gap so far (in a list)."""
    stall = [0.0]
    stop = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not stop.wait(0.01):
            now = time.monotonic()
            stall[0] = max(stall[0], now - last)
            last = now

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    time.sleep(0.05)
    try:
        yield stall
    finally:
        stop.set()
        thread.join(timeout=60)


def _open_fails_in_bound(options: dict[str, Any], address: str, option: str) -> None:
    opts = {**options, "setup_timeout_s": SETUP_TIMEOUT_S, "load_env": False}
    with ticking() as stall:
        t0 = time.monotonic()
        with pytest.raises(BackendTimeoutError) as err:
            open_store(make_config(opts)).close()
        elapsed = time.monotonic() - t0
    assert elapsed < BOUND_S and stall[0] < MAX_STALL_S, (
        f"open took {elapsed:.1f} s (setup_timeout_s={SETUP_TIMEOUT_S:g}) and blocked the other "
        f"threads for up to {stall[0]:.1f} s"
    )
    message = str(err.value)
    assert address in message and "setup_timeout_s" in message and option in message, message


def test_silent_master_address_fails_in_bound(mooncake_master: MooncakeMaster, silent: str) -> None:
    options = embedded_options(mooncake_master, master_server_address=silent)
    _open_fails_in_bound(options, silent, "master_server_address")


def test_silent_metadata_server_fails_in_bound(mooncake_master: MooncakeMaster, silent: str) -> None:
    url = f"http://{silent}/metadata"
    _open_fails_in_bound(embedded_options(mooncake_master, metadata_server=url), url, "metadata_server")


def test_silent_mooncake_client_fails_in_bound(mooncake_standalone: MooncakeStandalone, silent: str) -> None:
    options = mooncake_standalone.options(client_server_address=silent)
    _open_fails_in_bound(options, silent, "client_server_address")


def test_mooncake_client_silent_at_deferred_setup_fails_in_bound(
    mooncake_standalone: MooncakeStandalone,
) -> None:
    """The client answers when the store opens, then hangs before the deferred ``setup_dummy``
    (the first pool allocation, when the controller attaches)."""
    proxy = Endpoint(forward_to=mooncake_standalone.client.address)
    try:
        opts = mooncake_standalone.options(
            client_server_address=proxy.address, setup_timeout_s=SETUP_TIMEOUT_S, load_env=False
        )
        config = make_config(opts)
        store = open_store(config)
        proxy.silence()
        with ticking() as stall:
            t0 = time.monotonic()
            with pytest.raises(BackendTimeoutError) as err:
                CacheController(config, make_group("mha"), store=store).close()
            elapsed = time.monotonic() - t0
        store.close()
    finally:
        proxy.close()
    assert elapsed < BOUND_S and stall[0] < MAX_STALL_S, (
        f"attach took {elapsed:.1f} s (setup_timeout_s={SETUP_TIMEOUT_S:g}) and blocked the other "
        f"threads for up to {stall[0]:.1f} s"
    )
    message = str(err.value)
    assert proxy.address in message and "setup_timeout_s" in message and "client_server_address" in message
