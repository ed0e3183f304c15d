"""The OBJ side: one object per key in an S3-compatible bucket, moved by NIXL's OBJ plugin.

An object is the 4 KiB header then the payload, written by one PUT (NIXL's OBJ plugin writes
whole objects only), so S3's atomic PUT is the atomic publication: a reader sees no object, the
old one or the whole new one. Pages go through a staging buffer registered for the call (the
header and the payload must be one contiguous region). Existence is a HEAD per object through
boto3, bounded by ``timeout_s`` (NIXL's ``query_memory`` has no deadline). ``clear`` lists and
deletes through boto3 too, since NIXL has no list or delete. Credentials come from the
environment (``CREDENTIAL_ENV``) and go to NIXL and boto3 only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from hicache_core import BackendIOError, BackendUnavailableError

from ._agent import Agent, Hold, obj_ids
from ._format import HEADER, OTHER_SIZE, digest, memory, pack_header, verify_header
from ._options import CREDENTIAL_ENV, NixlOptions
from ._posix import Item

__all__ = ["ObjStore", "obj_params"]

log = logging.getLogger("hicache.nixl")


def _credentials() -> dict[str, str]:
    access, secret, token = (os.environ.get(name) for name in CREDENTIAL_ENV)
    if not access or not secret:
        raise BackendUnavailableError(
            f"backend 'nixl' with plugin 'obj' needs credentials in the environment: set "
            f"{CREDENTIAL_ENV[0]} and {CREDENTIAL_ENV[1]} (and {CREDENTIAL_ENV[2]} for temporary ones)"
        )
    out = {"access_key": access, "secret_key": secret}
    if token:
        out["session_token"] = token
    return out


def obj_params(options: NixlOptions) -> dict[str, str]:
    """The OBJ plugin's init parameters (credentials included: never log or show this dict)."""
    params = {"bucket": str(options.bucket), "region": options.region, **_credentials()}
    if options.endpoint:
        params["endpoint_override"] = options.endpoint
        params["scheme"] = options.endpoint.split(":", 1)[0]
        params["use_virtual_addressing"] = "false"
    return params


_agents: dict[tuple[str, ...], Agent] = {}
_agents_lock = threading.Lock()


def shared_agent(options: NixlOptions) -> Agent:
    """The process's NIXL agent with an OBJ plugin for these options (created once, never destroyed).

    Every OBJ plugin instance initialises the AWS SDK and shuts it down when destroyed; destroying
    one while another store's plugin is moving data aborted the process (seen under the
    conformance suite's concurrent stores). So stores with the same endpoint, bucket, region,
    timeout and credentials share one agent, kept until the process exits.
    """
    params = obj_params(options)
    hidden = {
        k: xxhash.xxh3_64_hexdigest(v.encode()) if "key" in k or "token" in k else v
        for k, v in params.items()
    }
    key = (*(f"{k}={v}" for k, v in sorted(hidden.items())), str(options.timeout_s))
    with _agents_lock:
        agent = _agents.get(key)
        if agent is None:
            agent = Agent(options.timeout_s)
            agent.create("OBJ", params)
            agent.shared = True
            _agents[key] = agent
        return agent


class ObjStore:
    """Objects ``{prefix}{key}`` in one bucket."""

    def __init__(self, agent: Agent, options: NixlOptions) -> None:
        self.agent = agent
        self.options = options
        self.prefix = options.prefix
        self.integrity_errors = 0
        self._s3: Any = None
        self._lock = threading.Lock()
        self._heads: ThreadPoolExecutor | None = None

    def _names(self, keys: Sequence[str]) -> list[str]:
        return [self.prefix + k for k in keys]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """One HEAD per object, in parallel, each bounded by ``timeout_s`` (NIXL's own query has no
        deadline: against a dead server it outlives any bound); ``BackendIOError`` when the store
        cannot answer."""
        if not keys:
            return []
        s3, bucket = self._client(), self.options.bucket

        def head(name: str) -> bool:
            try:
                s3.head_object(Bucket=bucket, Key=name)
                return True
            except Exception as err:
                code = str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))
                if code in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise BackendIOError(
                    f"hicache nixl: the object store did not answer for {name!r}: {type(err).__name__}: {err}"
                ) from None

        names = self._names(keys)
        if len(names) == 1:
            return [head(names[0])]
        return list(self._pool().map(head, names))

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._heads is None:
                self._heads = ThreadPoolExecutor(8, thread_name_prefix="hicache-nixl-head")
            return self._heads

    def put(self, items: Sequence[Item]) -> list[bool]:
        present = self.exists([it.key for it in items])  # an existing key is kept
        todo = [i for i, p in enumerate(present) if not p]
        out = list(present)
        if not todo:
            return out
        stage, offs = self._stage([items[i] for i in todo])
        for j, i in enumerate(todo):
            it = items[i]
            view = stage[offs[j] : offs[j] + HEADER + it.length]
            pos = HEADER
            for addr, n in it.segments:
                if n:
                    view[pos : pos + n] = memory(addr, n)
                    pos += n
            pack_header(view, it.key, it.length, digest([(view.ctypes.data + HEADER, it.length)]))
        if self._move("WRITE", [items[i] for i in todo], stage, offs):
            for i in todo:
                out[i] = True
            return out
        # which PUTs landed: S3 PUT is atomic, so an object there now is a whole one of this call
        try:
            now = self.exists([items[i].key for i in todo])
        except BackendIOError as err:
            log.warning("hicache nixl: after a failed write, existence is unknown: %s", err)
            return out
        for j, i in enumerate(todo):
            out[i] = now[j]
        return out

    def get(self, items: Sequence[Item]) -> list[bool]:
        out = [False] * len(items)
        if not items:
            return out
        stage, offs = self._stage(items)
        which = list(range(len(items)))
        hold = Hold(stage)
        if not self._move("READ", items, stage, offs, hold):
            if hold.abandoned:  # it may still write anywhere in `stage`: trust none of it
                return out
            # a missing object fails the whole transfer: read the ones that exist, one by one
            try:
                there = self.exists([it.key for it in items])
            except BackendIOError as err:
                log.warning("hicache nixl: read failed and the store cannot be queried: %s", err)
                return out
            which = [i for i in which if there[i] and self._move("READ", [items[i]], stage, [offs[i]])]
        for i in which:
            it = items[i]
            view = stage[offs[i] : offs[i] + HEADER + it.length]
            want = verify_header(view, it.key, it.length)
            if want == OTHER_SIZE:
                continue  # stored for another page size: a miss, not corruption
            if want is None or want != digest([(view.ctypes.data + HEADER, it.length)]):
                self._corrupt(it.key)
                continue
            pos = HEADER
            for addr, n in it.segments:
                if n:
                    memory(addr, n)[:] = view[pos : pos + n]
                    pos += n
            out[i] = True
        return out

    @staticmethod
    def _stage(items: Sequence[Item]) -> tuple[np.ndarray, list[int]]:
        offs = []
        total = 0
        for it in items:
            offs.append(total)
            total += HEADER + it.length
        return np.zeros(total, dtype=np.uint8), offs

    def _move(
        self, op: str, items: Sequence[Item], stage: np.ndarray, offs: Sequence[int], hold: Hold | None = None
    ) -> bool:
        agent = self.agent
        base = stage.ctypes.data
        ids = obj_ids(len(items))
        names = self._names([it.key for it in items])
        sizes = [HEADER + it.length for it in items]
        hold = hold or Hold(stage)
        dreg = agent.register([(base, stage.nbytes, 0, "")], "DRAM")
        try:
            oreg = agent.register([(0, s, d, n) for s, d, n in zip(sizes, ids, names)], "OBJ")
            try:
                local = [(base + o, s, 0) for o, s in zip(offs, sizes)]
                remote = [(0, s, d) for s, d in zip(sizes, ids)]
                return agent.transfer(op, local, remote, "OBJ", keep=hold)
            finally:
                if not hold.abandoned:
                    agent.deregister(oreg)
        finally:
            if not hold.abandoned:
                agent.deregister(dreg)

    def _corrupt(self, key: str) -> None:
        """Count, log and delete a damaged object (a later backup writes it again)."""
        with self._lock:
            self.integrity_errors += 1
        name = self.prefix + key
        log.warning("hicache nixl: object %s failed its checksum; treated as a miss and deleted", name)
        try:
            self._client().delete_object(Bucket=self.options.bucket, Key=name)
        except Exception as err:  # the next read finds it damaged again: still only a miss
            log.warning("hicache nixl: deleting damaged object %s failed: %s", name, type(err).__name__)

    def clear(self, namespace: str) -> int:
        s3 = self._client()
        prefix = self.prefix + namespace + "."
        removed = 0
        try:
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=self.options.bucket, Prefix=prefix)
            for page in pages:
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    s3.delete_objects(Bucket=self.options.bucket, Delete={"Objects": keys, "Quiet": True})
                    removed += len(keys)
        except Exception as err:
            raise BackendIOError(
                f"hicache nixl: clearing {prefix!r} failed: {type(err).__name__}: {err}"
            ) from None
        return removed

    def _client(self) -> Any:
        if self._s3 is None:
            try:
                import boto3
            except ImportError as err:
                raise BackendUnavailableError(
                    f"hicache nixl: clearing an obj store needs boto3 ({err}); `pip install hicache-nixl` installs it"
                ) from None
            from botocore.config import Config

            creds = _credentials()
            t = self.options.timeout_s
            self._s3 = boto3.client(
                "s3",
                endpoint_url=self.options.endpoint,
                region_name=self.options.region,
                aws_access_key_id=creds["access_key"],
                aws_secret_access_key=creds["secret_key"],
                aws_session_token=creds.get("session_token"),
                config=Config(
                    connect_timeout=min(t, 10.0),
                    read_timeout=t,
                    retries={"max_attempts": 2, "mode": "standard"},
                    max_pool_connections=16,
                ),
            )
        return self._s3

    def close(self) -> None:
        with self._lock:
            heads, self._heads = self._heads, None
        if heads is not None:
            heads.shutdown(wait=True)  # each HEAD is bounded by timeout_s
        self._s3 = None
