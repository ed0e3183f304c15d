"""Second process of ``test_shared_two_processes`` (``python -m hicache_core.testing._child``).

The child stays alive while the parent checks its pages (some stores, such as Mooncake, keep a
page in the memory of the process that wrote it, so the writer must still be running). Protocol,
one JSON object per line: the first line on stdin opens the store (``config``, ``geometry``,
``pages``); then ``{"op": "read", "hashes": [...]}`` (exists + get + sha256 of each component),
``{"op": "write", "hashes": [...]}`` (default bytes with salt 11, set; with ``"each": true`` one
call per page, so that writes of two processes interleave; with ``"start_at"``, a ``time.time()``,
the first set waits until then, so that the parent can start its own sets at the same moment;
with ``"warm"`` the first page is set once before that; the reply's ``span`` is the
``time.time()`` of the first timed set's start and of the last one's end)
or ``{"op": "exit"}``.
Each reply is one stdout line prefixed with :data:`PREFIX` (other output is ignored).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from typing import IO, Any

__all__ = ["PREFIX", "Child", "main"]

PREFIX = "HICACHE-CHILD "
WRITE_SALT = 11


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    """Serve the parent's requests over stdin/stdout (see the module docstring)."""
    import torch

    from hicache_core import IoOp, MHAKVPool, PoolName, PoolTransfer, StorageConfig, open_store

    from ._context import default_page_bytes, tensor_digest

    setup: dict[str, Any] = json.loads(sys.stdin.readline())
    geo = setup["geometry"]
    dtype = getattr(torch, geo["dtype"])
    shape = (geo["page_size"], geo["num_layers"], geo["num_heads"], geo["head_dim"])
    pool = MHAKVPool(setup["pages"], shape[0], shape[1], shape[2], shape[3], dtype)
    with open_store(StorageConfig(**setup["config"])) as store:
        store.register_pool(PoolName.KV, pool)
        v1 = store.capabilities.v1

        def io(op: IoOp, hashes: list[str], slots: list[int] | None = None) -> list[bool]:
            idx = list(range(len(hashes))) if slots is None else slots
            if not v1:
                keys = tuple(store.page_keys(PoolName.KV, hashes))
                transfer = PoolTransfer(PoolName.KV, tuple(idx), tuple(hashes), keys=keys)
                return store.batch_io_v2(op, [transfer])[0]
            flat_keys = [k for page in store.page_keys(PoolName.KV, hashes) for k in page]
            views = [v for page in pool.page_views(idx) for v in page]
            flat = store.batch_io_v1(op, flat_keys, None if op is IoOp.EXISTS else views, PoolName.KV)
            return [all(flat[i : i + 2]) for i in range(0, len(flat), 2)]

        def digests(n: int) -> list[list[str]]:
            return [[tensor_digest(v) for v in views] for views in pool.page_views(range(n))]

        _emit({"ready": True})
        for line in sys.stdin:
            cmd = json.loads(line)
            hashes: list[str] = cmd.get("hashes", [])
            if cmd["op"] == "read":
                exists = io(IoOp.EXISTS, hashes)
                for views in pool.page_views(range(len(hashes))):
                    for v in views:
                        v.fill_(0xA5)
                got = io(IoOp.GET, hashes)
                _emit({"exists": exists, "get": got, "digests": digests(len(hashes))})
            elif cmd["op"] == "write":
                for views, h in zip(pool.page_views(range(len(hashes))), hashes):
                    for comp, v in zip(pool.components, views):
                        v.copy_(default_page_bytes(h, comp, v.numel(), WRITE_SALT).view(v.shape))
                if cmd.get("warm") and hashes:  # the first set's one-time costs, before start_at
                    io(IoOp.SET, hashes[:1])
                time.sleep(max(0.0, float(cmd.get("start_at", 0.0)) - time.time()))
                began = time.time()
                if cmd.get("each"):
                    flags = [io(IoOp.SET, [h], [i])[0] for i, h in enumerate(hashes)]
                else:
                    flags = io(IoOp.SET, hashes)
                span = [began, time.time()]
                _emit({"digests": digests(len(hashes)), "set": flags, "span": span})
            else:
                break
    _emit({"closed": True})
    return 0


class Child:
    """The parent's handle: start ``python -m hicache_core.testing._child`` and talk to it."""

    def __init__(self, setup: dict[str, Any], env: dict[str, str], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hicache_core.testing._child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._read_stdout, args=(self.proc.stdout,), daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(self.proc.stderr,), daemon=True).start()
        self._send(setup)
        self._reply()

    def _read_stdout(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith(PREFIX):
                self._replies.put(json.loads(line[len(PREFIX) :]))
        self._replies.put(None)

    def _read_stderr(self, stream: IO[str]) -> None:
        for line in stream:
            self._stderr.append(line)
            del self._stderr[:-200]

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _reply(self) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=self.timeout_s)
        except queue.Empty:
            reply = None
        if reply is None:
            raise AssertionError(
                f"the second process did not answer (exit code {self.proc.poll()}):\n"
                + "".join(self._stderr)[-3000:]
            )
        return reply

    def call(self, op: str, hashes: list[str]) -> dict[str, Any]:
        """Send one request and wait for its reply."""
        self._send({"op": op, "hashes": hashes})
        return self._reply()

    def send(self, op: str, hashes: list[str], **extra: Any) -> None:
        """Send one request without waiting (:meth:`reply` collects the answer)."""
        self._send({"op": op, "hashes": hashes, **extra})

    def reply(self) -> dict[str, Any]:
        """The answer to the request sent last."""
        return self._reply()

    def kill(self) -> None:
        """End the child at once (SIGKILL): its store is never closed, as after a crash."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Ask the child to close its store and exit; kill it if it does not."""
        try:
            if self.proc.poll() is None:
                self._send({"op": "exit"})
                self.proc.wait(timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
