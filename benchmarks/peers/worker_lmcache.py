"""Peer worker: LMCache's local-disk backend (``LocalDiskBackend``), one file per chunk, on CPU.

Run with ``benchmarks/.peers/lmcache/bin/python``. LMCache's own objects, as its storage
manager drives them: a ``LocalCPUBackend`` (the allocator of its host memory objects, its CPU
cache off) and a ``LocalDiskBackend`` with its asyncio loop on a thread. A write is
``batched_submit_put_task`` and returns when every page's completion callback has run; a read
is ``batched_get_blocking`` (its thread pool reads into memory objects it allocates). Setting:
``buffered`` (LMCache's default) or ``odirect`` (its ``use_odirect`` extra config).
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import os
import sys
import threading
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

GIB = 1024**3


class LMCacheDisk:
    def __init__(self, root: str, page_bytes: int, n: int, setting: str) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        total = page_bytes * n
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=False,
            max_local_cpu_size=(2 * total + 64 * 1024**2) / GIB,
            local_disk=root,
            max_local_disk_size=(2 * total) / GIB,
            lmcache_instance_id=f"peers-{os.getpid()}",
            extra_config={"use_odirect": setting == "odirect"},
        )
        metadata = LMCacheMetadata(
            model_name=f"peers-{page_bytes}",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(1, 2, 256, 1, page_bytes // 1024),
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cpu = LocalCPUBackend(config, metadata)
        self.disk = LocalDiskBackend(config, self.loop, self.cpu, dst_device="cpu")
        self.keys = [
            CacheEngineKey(
                model_name=f"peers-{page_bytes}",
                world_size=1,
                worker_id=0,
                chunk_hash=i,
                dtype=torch.bfloat16,
            )
            for i in range(n)
        ]
        # KV_2LTD [2, layers, tokens, hidden] in bf16: one 256-token chunk of page_bytes bytes
        shape = torch.Size([2, 1, 256, page_bytes // 1024])
        self.src = [self.cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD) for _ in range(n)]
        if any(o is None for o in self.src):
            raise RuntimeError("LMCache's CPU allocator is out of memory")
        self.got: list[Any] = []
        self.u8 = torch.uint8
        self.n = n
        self._done = threading.Semaphore(0)

    def fill(self, i: int, data: memoryview) -> None:
        self.src[i].tensor.view(-1).view(self.u8).numpy()[:] = memoryview(data).cast("B")

    def write(self) -> None:
        self.disk.batched_submit_put_task(
            self.keys, self.src, on_complete_callback=lambda _key: self._done.release()
        )
        for _ in range(self.n):
            if not self._done.acquire(timeout=300):
                raise RuntimeError("LMCache did not complete its puts in 300 s")

    def clear(self) -> None:
        for o in self.got:
            if o is not None:
                o.ref_count_down()
        self.got = []

    def read(self) -> int:
        self.got = self.disk.batched_get_blocking(self.keys)
        return sum(1 for o in self.got if o is not None)

    def page(self, i: int) -> bytes:
        o = self.got[i]
        return b"" if o is None else o.tensor.reshape(-1).view(self.u8).numpy().tobytes()

    def close(self) -> None:
        self.clear()
        self.disk.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _load() -> tuple[_common.Factory, dict[str, str]]:
    import torch
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401

    versions = {
        "python": sys.version.split()[0],
        "lmcache": md.version("lmcache"),
        "torch": torch.__version__,
    }
    return LMCacheDisk, versions


if __name__ == "__main__":
    sys.exit(_common.serve(_load))
