"""Peer worker: hicache through ``hicache_core.CacheController`` with real host pools.

Run with the repository's own venv (``.venv/bin/python``). Setting: JSON
``{"backend": NAME, "options": {...}}``; ``root`` is added to the options (e.g. ``file`` with
``{"layout": "segments"}``, or the ``nixl`` plugin with its POSIX engine settings). The pool is an MHA ``page_first`` KV pool, as a user with a
Llama-style model has: a page is K and V, each half of the page's bytes. Controller and backend
run at their defaults (batch size, I/O threads), as a user gets them.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

LAYERS, HEADS, HEAD_DIM = 16, 2, 64  # bf16: 256 bytes per token per layer and component


class HiCache:
    def __init__(self, root: str, page_bytes: int, n: int, setting: str) -> None:
        import torch

        from hicache_core import CacheController, MHAKVPool, StorageConfig, page_hashes

        half = page_bytes // 2
        tokens = half // (LAYERS * HEADS * HEAD_DIM * 2)
        if tokens * LAYERS * HEADS * HEAD_DIM * 2 != half:
            raise ValueError(f"page of {page_bytes} bytes is not a whole number of tokens")
        self.pool = MHAKVPool(n, tokens, LAYERS, HEADS, HEAD_DIM, torch.bfloat16, layout="page_first")
        self.bufs = self.pool.buffers()
        self.views = [[b[i].numpy().data.cast("B") for b in self.bufs] for i in range(n)]
        self.half = half
        self.n = n
        self.idx = list(range(n))
        self.hashes = page_hashes(list(range(n * 4)), 4)
        spec = json.loads(setting)
        options: dict[str, Any] = {**spec.get("options", {}), "root": root}
        cfg = StorageConfig(backend=spec["backend"], options=options, model_name=f"peers-{page_bytes}")
        self.ctl = CacheController(cfg, self.pool)

    def fill(self, i: int, data: memoryview) -> None:
        k, v = self.views[i]
        k[:] = data[: self.half]
        v[:] = data[self.half :]

    def write(self) -> None:
        res = self.ctl.backup(self.hashes, self.idx)
        if res.pages != self.n:
            raise RuntimeError(f"backup stored {res.pages}/{self.n} pages")

    def clear(self) -> None:
        for b in self.bufs:
            b.zero_()

    def read(self) -> int:
        return int(self.ctl.prefetch(self.hashes, self.idx).pages)

    def page(self, i: int) -> bytes:
        k, v = self.views[i]
        return bytes(k) + bytes(v)

    def close(self) -> None:
        self.ctl.close()


def _load() -> tuple[_common.Factory, dict[str, str]]:
    import torch

    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "hicache-core": md.version("hicache-core"),
    }
    for dist in ("hicache-file", "hicache-nixl"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return HiCache, versions


if __name__ == "__main__":
    sys.exit(_common.serve(_load))
