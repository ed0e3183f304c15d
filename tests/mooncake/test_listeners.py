"""Listeners: with every configured address on 127.0.0.1, each Mooncake process the plugin and
its fixtures start or configure listens on 127.0.0.1 only, except the listeners Mooncake 0.3.x
cannot pin (one handshake RPC on ``0.0.0.0`` and one TCP transport on ``[::]`` per transfer
engine), and those the plugin names in one warning per setup. Any other listener on every
interface, or one more of the known kind, fails the test.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from hicache_mooncake.testing import MooncakeStandalone

WORKER = Path(__file__).with_name("listeners_worker.py")
WILDCARDS = ("0.0.0.0", "::")
# what a warning names: "0.0.0.0:15269" or "[::]:15846"
NAMED = re.compile(r"(0\.0\.0\.0|\[::\]):(\d+)")


def _listening(proc: psutil.Process) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN
    }


def _named(warnings: list[str]) -> set[tuple[str, int]]:
    return {(ip.strip("[]"), int(port)) for w in warnings for ip, port in NAMED.findall(w)}


def _report(worker: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    assert worker.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([worker.stdout], [], [], 0.5)
        if ready:
            line = worker.stdout.readline()
            if line.startswith("{"):
                return dict(json.loads(line))
            if not line and worker.poll() is not None:
                break
    raise AssertionError(f"listener worker gave no report (exit code {worker.poll()})")


def test_listeners_bind_loopback_or_are_named(tmp_path: Path) -> None:
    me = psutil.Process()
    earlier = {p.pid for p in me.children(recursive=True)}
    with MooncakeStandalone(global_segment_size="64MB") as cluster:
        log = open(tmp_path / "worker.log", "w")
        worker = subprocess.Popen(
            [sys.executable, str(WORKER), cluster.master.address, cluster.master.metadata_server,
             cluster.client.address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            report = _report(worker, timeout=120.0)
            started = [p for p in me.children(recursive=True) if p.pid not in earlier]
            assert any(p.pid == worker.pid for p in started)
            listening = {p.pid: _listening(p) for p in started}
            names = {p.pid: f"{p.name()} (pid {p.pid})" for p in started}
        finally:
            assert worker.stdin is not None
            worker.stdin.close()
            worker.wait(timeout=60)
            log.close()

    exposed = {pid: {a for a in addrs if a[0] in WILDCARDS} for pid, addrs in listening.items()}
    warnings = [w for w in report["warnings"] if "every interface" in w]
    named = _named(warnings)
    unnamed = {names[pid]: sorted(a - named) for pid, a in exposed.items() if a - named}
    assert not unnamed, (
        f"listening on every interface, neither pinned to 127.0.0.1 nor named in a warning: {unnamed}"
    )

    # The known set: the two transfer-engine listeners Mooncake 0.3.x binds to every interface,
    # for each engine: two in the serving process (two embedded clients), one in the
    # mooncake_client; nothing anywhere else (master, metadata server).
    client = next(pid for pid, n in names.items() if n.startswith("mooncake_client"))
    shape = {pid: sorted(ip for ip, _ in a) for pid, a in exposed.items()}
    assert shape.pop(worker.pid) == ["0.0.0.0", "0.0.0.0", "::", "::"], names[worker.pid]
    assert shape.pop(client) == ["0.0.0.0", "::"], names[client]
    assert all(not s for s in shape.values()), {names[p]: s for p, s in shape.items()}
    assert named == set().union(*exposed.values()), (warnings, exposed)
    assert len(warnings) == 3, warnings  # one per setup: two embedded, one standalone

    # every port the cluster was configured with listens on 127.0.0.1 only
    everything = set().union(*listening.values())
    for port in (cluster.master.rpc_port, cluster.master.admin_port, cluster.master.http_port,
                 cluster.client.port):  # fmt: skip
        assert {ip for ip, p in everything if p == port} == {"127.0.0.1"}, (port, everything)
