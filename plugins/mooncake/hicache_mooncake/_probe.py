"""Bounded checks that a Mooncake endpoint answers, run before calling into Mooncake.

``setup()`` and ``setup_dummy()`` hold the GIL for as long as they block, and their RPC client
waits 30 s for an answer, so a port that accepts connections but never answers (a hung master,
another service) would freeze every Python thread of the process for 30 s. These probes use
plain Python sockets (which release the GIL) with a deadline instead:

* :func:`rpc_probe` sends a ``coro_rpc`` request for a function id no server registers; the
  master's RPC service and the ``mooncake_client`` service answer it at once with a
  "function not registered" response (measured on 0.3.13).
* :func:`http_probe` sends a ``GET`` for an absent key to an HTTP metadata server; any HTTP
  status line is an answer.
"""

from __future__ import annotations

import random
import socket
import struct
import time
from collections.abc import Callable
from typing import Literal, NamedTuple
from urllib.parse import urlsplit

from hicache_core import BackendIOError, BackendTimeoutError

__all__ = ["ProbeFailure", "await_answer", "http_probe", "rpc_probe", "split_address", "tcp_probe"]

# coro_rpc (yalantinglibs) framing, little endian. Request: magic, version, serialize type,
# message type, sequence number, function id, body length, attachment length. Response: magic,
# version, error code, message type, sequence number, body length, attachment length.
_RPC_MAGIC = 21
_RPC_REQUEST = struct.Struct("<BBBBIIII")
_RPC_RESPONSE = struct.Struct("<BBBBIII")
_UNREGISTERED_FUNCTION = 0  # coro_rpc ids are 32-bit hashes of function names; 0 names none


class ProbeFailure(NamedTuple):
    """Why an endpoint did not answer, and how: ``refused`` (no connection: nothing listens, or
    the address does not resolve; may change when the service starts), ``silent`` (nothing came
    back before the deadline: a hung service or a dropped connect) or ``foreign`` (something
    else answered: another service on that port)."""

    why: str
    kind: Literal["refused", "silent", "foreign"]


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (IPv6 hosts may be bracketed)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def tcp_probe(address: str, timeout: float) -> str | None:
    """``None`` when ``host:port`` accepts a TCP connection within ``timeout``, else the reason."""
    try:
        with socket.create_connection(split_address(address), timeout=timeout):
            return None
    except OSError as err:
        return err.strerror or type(err).__name__


def _connect(host: str, port: int, deadline: float) -> socket.socket | ProbeFailure:
    try:
        return socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic()))
    except TimeoutError:
        return ProbeFailure("no TCP connection within the deadline", kind="silent")
    except OSError as err:
        return ProbeFailure(err.strerror or type(err).__name__, kind="refused")


def _receive(sock: socket.socket, nbytes: int, deadline: float) -> bytes | None:
    """Up to ``nbytes`` (fewer on EOF), or ``None`` when nothing arrived before ``deadline``."""
    data = b""
    while len(data) < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            return data or None
        sock.settimeout(left)
        try:
            chunk = sock.recv(nbytes - len(data))
        except TimeoutError:
            return data or None
        if not chunk:
            break
        data += chunk
    return data


def rpc_probe(address: str, timeout: float) -> ProbeFailure | None:
    """``None`` when ``host:port`` answers a Mooncake (``coro_rpc``) request within ``timeout``."""
    deadline = time.monotonic() + timeout
    host, port = split_address(address)
    sock = _connect(host, port, deadline)
    if isinstance(sock, ProbeFailure):
        return sock
    seq = random.getrandbits(32)
    with sock:
        try:
            sock.sendall(_RPC_REQUEST.pack(_RPC_MAGIC, 0, 0, 0, seq, _UNREGISTERED_FUNCTION, 0, 0))
            head = _receive(sock, _RPC_RESPONSE.size, deadline)
        except OSError as err:
            return ProbeFailure(err.strerror or type(err).__name__, kind="refused")
    if head is None:
        return ProbeFailure("accepted the connection but sent nothing back", kind="silent")
    if len(head) < _RPC_RESPONSE.size:
        return ProbeFailure("closed the connection without a Mooncake RPC answer", kind="foreign")
    magic, _, _, _, got_seq, _, _ = _RPC_RESPONSE.unpack(head)
    if magic != _RPC_MAGIC or got_seq != seq:
        return ProbeFailure("answered, but not with the Mooncake RPC protocol", kind="foreign")
    return None


def http_probe(url: str, timeout: float) -> ProbeFailure | None:
    """``None`` when the HTTP server of ``url`` sends a status line within ``timeout``."""
    deadline = time.monotonic() + timeout
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    conn = _connect(host, port, deadline)
    if isinstance(conn, ProbeFailure):
        return conn
    try:
        if parts.scheme == "https":
            import ssl

            conn.settimeout(max(0.01, deadline - time.monotonic()))
            conn = ssl.create_default_context().wrap_socket(conn, server_hostname=host)
        request = f"GET {parts.path or '/'}?key=hicache-probe HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n"
        conn.sendall(request.encode("ascii", "replace"))
        head = _receive(conn, 5, deadline)
    except TimeoutError:
        return ProbeFailure("sent nothing back", kind="silent")
    except OSError as err:
        return ProbeFailure(err.strerror or type(err).__name__, kind="refused")
    finally:
        conn.close()
    if head is None:
        return ProbeFailure("accepted the connection but sent nothing back", kind="silent")
    if head != b"HTTP/":
        return ProbeFailure("answered, but not with HTTP", kind="foreign")
    return None


def await_answer(
    what: str,
    address: str,
    probe: Callable[[str, float], ProbeFailure | None],
    deadline: float,
    setup_timeout_s: float,
    fix: str,
) -> None:
    """Probe ``address`` until it answers. A refusal is retried until ``deadline`` (the service
    may be starting); a silent or foreign endpoint fails at once. Raises
    :class:`BackendTimeoutError` (no answer within ``setup_timeout_s``) or
    :class:`BackendIOError` (another service answered); ``what`` and ``fix`` go in the message."""
    limit = f"setup_timeout_s={setup_timeout_s:g} s"
    while True:
        fail = probe(address, max(0.05, deadline - time.monotonic()))
        if fail is None:
            return
        if fail.kind == "refused":
            if time.monotonic() + 0.1 < deadline:
                time.sleep(0.1)
                continue
            raise BackendTimeoutError(f"mooncake: {what} is not reachable ({fail.why}) within {limit}; {fix}")
        if fail.kind == "silent":
            raise BackendTimeoutError(
                f"mooncake: {what} did not answer within {limit} ({fail.why}): a hung process or "
                f"another service on that port; {fix}, or raise setup_timeout_s if it is only slow"
            )
        raise BackendIOError(f"mooncake: {what} is not the expected Mooncake service ({fail.why}); {fix}")
