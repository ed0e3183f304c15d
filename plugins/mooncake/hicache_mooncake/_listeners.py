"""The TCP listeners of a process, read from Linux ``/proc`` (no dependencies).

Mooncake 0.3.x binds two listeners of every transfer engine to every interface, with no option
or environment variable to pin them: the handshake RPC (``0.0.0.0``) and the TCP transport
(``[::]``, dual-stack), which reads and writes any registered memory of the process (the host
KV pools) for whoever connects. Each takes a random port in ``MC_MIN_RPC_PORT`` to
``MC_MAX_RPC_PORT`` (15000-17000 by default); ``MC_TCP_BIND_ADDRESS`` only changes the address
the engine advertises.
The plugin cannot close that gap, so it finds these listeners after each setup and names their
ports in one warning (see ``Security`` in the README). Everything here fails soft: without
``/proc`` it finds nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Listener", "find_listening_process", "listeners", "socket_inodes", "warn_exposed"]

log = logging.getLogger("hicache.mooncake")

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp*
WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket: the address it is bound to, its port and its socket inode."""

    host: str
    port: int
    inode: int

    @property
    def wildcard(self) -> bool:
        """Bound to every interface (``0.0.0.0`` or ``[::]``)."""
        return self.host in WILDCARDS

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _address(hex_addr: str) -> tuple[str, int]:
    """``/proc/net/tcp*`` ``ADDR:PORT`` (address in 32-bit host-order words) as ``(host, port)``."""
    addr, _, port = hex_addr.partition(":")
    raw = bytes.fromhex(addr)
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, swapped), int(port, 16)


def _table() -> dict[int, Listener]:
    """Every listening TCP socket of this network namespace, by inode."""
    out: dict[int, Listener] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name, encoding="ascii") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            host, port = _address(fields[1])
            inode = int(fields[9])
            out[inode] = Listener(host, port, inode)
    return out


def socket_inodes(pid: int | str = "self") -> set[int]:
    """Inodes of the sockets process ``pid`` holds open (empty when unreadable)."""
    out: set[int] = set()
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def listeners(pid: int | str = "self") -> list[Listener]:
    """The listening TCP sockets of process ``pid``, by port."""
    table = _table()
    return sorted((table[i] for i in socket_inodes(pid) if i in table), key=lambda x: (x.port, x.host))


def find_listening_process(port: int, name_part: str = "mooncake") -> int | None:
    """The pid of a process whose name contains ``name_part`` and that listens on ``port``
    (only processes this user may inspect; ``None`` when none is found)."""
    wanted = {i for i, lst in _table().items() if lst.port == port}
    if not wanted:
        return None
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
                if name_part not in f.read():
                    continue
        except OSError:
            continue
        if socket_inodes(pid) & wanted:
            return int(pid)
    return None


def warn_exposed(exposed: Iterable[Listener], whose: str) -> None:
    """One warning naming the listeners of ``whose`` that accept connections on every interface."""
    ports = ", ".join(str(x) for x in exposed)
    if not ports:
        return
    log.warning(
        "hicache mooncake: %s listens on every interface at %s: the transfer engine's handshake "
        "RPC and TCP transport, which read and write registered memory (the host KV pools) for "
        "any peer. Mooncake 0.3.x has no option to bind them to one address (MC_TCP_BIND_ADDRESS "
        "only sets the address it advertises); let only trusted hosts reach these ports, e.g. "
        "with a host firewall (README of hicache-mooncake, 'Security')",
        whose,
        ports,
    )
