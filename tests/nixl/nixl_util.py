"""Helpers of the nixl tests: the S3 server process and the backend's options."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from typing import Any

from hicache_core.plugin.registry import availability, load_backend_class

HAVE_MOTO = importlib.util.find_spec("moto") is not None


def _nixl_missing() -> str | None:
    try:
        return availability(load_backend_class("nixl"))
    except Exception as err:  # not installed: say so, never build against a fake
        return f"hicache-nixl is not usable: {type(err).__name__}: {err}"


NIXL_MISSING = _nixl_missing()


def s3_env() -> dict[str, str]:
    """Dummy credentials for the local server, and no instance-metadata probing by the AWS SDK."""
    return {
        "AWS_ACCESS_KEY_ID": "hicache-test",
        "AWS_SECRET_ACCESS_KEY": "hicache-test-secret",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """``python -m moto.server`` on 127.0.0.1 (in-memory: a restart starts empty)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, **s3_env())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("moto server did not listen within 30 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def client(self) -> Any:
        import boto3

        env = s3_env()
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def options(self, bucket: str, **extra: Any) -> dict[str, Any]:
        return {"plugin": "obj", "endpoint": self.endpoint, "bucket": bucket, **extra}


# ---------------------------------------------------------------- pages and controllers
def hex_hash(ns: str, i: int) -> str:
    """A valid page hash (64 hex digits) for page ``i`` of series ``ns``."""
    import hashlib

    return hashlib.sha256(f"{ns}:{i}".encode()).hexdigest()


def page_bytes(page_hash: str, component: int, nbytes: int) -> bytes:
    """The deterministic content of one page component (writers and verifiers agree)."""
    import hashlib

    return hashlib.shake_128(f"{page_hash}/{component}".encode()).digest(nbytes)


def kv_pool(pages: int, *, layout: str = "page_first", head_dim: int = 64, layers: int = 2, **kw: Any) -> Any:
    """An MHA KV pool: page components of ``16 * 2 * head_dim * 2 * layers`` bytes (4 KiB per layer)."""
    import torch

    import hicache_core as hc

    return hc.MHAKVPool(pages, 16, layers, 2, head_dim, torch.bfloat16, layout=layout, **kw)


def fill(pool: Any, slots: list[int], hashes: list[str]) -> None:
    import torch

    sizes = pool.component_nbytes
    for slot, h in zip(slots, hashes):
        for c, view in enumerate(pool.page_views([slot])[0]):
            data = torch.frombuffer(bytearray(page_bytes(h, c, sizes[c])), dtype=torch.uint8)
            view.copy_(data.view(view.shape))


def matches(pool: Any, slot: int, page_hash: str) -> bool:
    sizes = pool.component_nbytes
    return all(
        v.contiguous().numpy().tobytes() == page_bytes(page_hash, c, sizes[c])
        for c, v in enumerate(pool.page_views([slot])[0])
    )


def controller(options: dict[str, Any], pool: Any, model: str = "nixl-test", **settings: Any) -> Any:
    import hicache_core as hc

    cfg = hc.StorageConfig(backend="nixl", options=options, model_name=model, **settings)
    return hc.CacheController(cfg, hc.HostPoolGroup(pool))
