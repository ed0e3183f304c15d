"""Peer worker: SGLang's ``HiCacheFile`` (``batch_set`` / ``batch_get``), one file per page.

Run with ``benchmarks/.peers/sglang/bin/python`` (sglang installed without its dependencies,
see ``setup-peers.sh``). This is the path SGLang's HiCache takes for its ``file`` storage
backend without zero copy: one flat tensor per page (K and V together) per key. Setting:
``default`` (SGLang's defaults: no metadata cache, one thread).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common


class SGLangFile:
    def __init__(self, root: str, page_bytes: int, n: int, setting: str) -> None:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

        cfg = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name=f"peers-{page_bytes}",
        )
        self.store = HiCacheFile(cfg, file_path=root)
        self.src = torch.empty((n, page_bytes), dtype=torch.uint8)
        self.dst = torch.empty((n, page_bytes), dtype=torch.uint8)
        self.keys = [f"{i:064x}" for i in range(n)]
        self.n = n

    def fill(self, i: int, data: memoryview) -> None:
        self.src[i].numpy()[:] = memoryview(data).cast("B")

    def write(self) -> None:
        if not self.store.batch_set(self.keys, [self.src[i] for i in range(self.n)]):
            raise RuntimeError("HiCacheFile.batch_set failed")

    def clear(self) -> None:
        self.dst.zero_()

    def read(self) -> int:
        got = self.store.batch_get(self.keys, [self.dst[i] for i in range(self.n)])
        return sum(1 for t in got if t is not None)

    def page(self, i: int) -> memoryview:
        return self.dst[i].numpy().data.cast("B")

    def close(self) -> None:
        pass


def _load() -> tuple[_common.Factory, dict[str, str]]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: F401

    versions = {"python": sys.version.split()[0], "sglang": md.version("sglang"), "torch": torch.__version__}
    return SGLangFile, versions


if __name__ == "__main__":
    sys.exit(_common.serve(_load))
