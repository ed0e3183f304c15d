"""Second process of ``test_shared_two_processes`` (``python -m hicache_core.testing._child``).

Reads one JSON request on stdin: the store config, the pool geometry, pages to read (with the
expected sha256 of each component) and pages to write. Prints one JSON reply on stdout.
Only the public API is used, as by any other process sharing the backend.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> int:
    import torch

    from hicache_core import IoOp, MHAKVPool, PoolName, PoolTransfer, StorageConfig, open_store

    from ._context import default_page_bytes, tensor_digest

    req: dict[str, Any] = json.load(sys.stdin)
    geo = req["geometry"]
    read: list[str] = req["read"]
    write: list[str] = req["write"]
    n = max(len(read), len(write), 1)
    pool = MHAKVPool(
        n, geo["page_size"], geo["num_layers"], geo["num_heads"], geo["head_dim"], getattr(torch, geo["dtype"])
    )
    with open_store(StorageConfig(**req["config"])) as store:
        store.register_pool(PoolName.KV, pool)
        v1 = store.capabilities.v1

        def io(op: IoOp, hashes: list[str]) -> list[bool]:
            idx = list(range(len(hashes)))
            if not v1:
                keys = store.page_keys(PoolName.KV, hashes)
                return store.batch_io_v2(op, [PoolTransfer(PoolName.KV, tuple(idx), tuple(hashes), keys=keys)])[0]
            keys = [k for page in store.page_keys(PoolName.KV, hashes) for k in page]
            views = [v for page in pool.page_views(idx) for v in page]
            flat = store.batch_io_v1(op, keys, None if op is IoOp.EXISTS else views)
            return [all(flat[i : i + 2]) for i in range(0, len(flat), 2)]

        reply: dict[str, Any] = {"exists": io(IoOp.EXISTS, read)}
        for views in pool.page_views(range(n)):
            for v in views:
                v.fill_(0xA5)
        reply["get"] = io(IoOp.GET, read)
        reply["read_digests"] = [[tensor_digest(v) for v in views] for views in pool.page_views(range(len(read)))]
        for views, h in zip(pool.page_views(range(len(write))), write):
            for comp, v in zip(pool.components, views):
                v.copy_(default_page_bytes(h, comp, v.numel(), 11).view(v.shape))
        reply["write_digests"] = [[tensor_digest(v) for v in views] for views in pool.page_views(range(len(write)))]
        reply["set"] = io(IoOp.SET, write)
    json.dump(reply, sys.stdout)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
