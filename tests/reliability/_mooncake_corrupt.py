"""Child process: flip bytes of pages stored in a real (embedded) Mooncake store, then read them.

``python -m tests.reliability._mooncake_corrupt`` prints one JSON object. Run it with
``MOONCAKE_STORE_CHECKSUM=1`` (object CRC-64, read by the Mooncake client when it is first
created, so it needs a fresh process) or without it. In embedded mode the store's segment is
this process's memory, so ``get_replica_desc(key)`` gives the address of the stored bytes.
"""

from __future__ import annotations

import ctypes
import json
import random
import time

import torch

import hicache_core as hc
from hicache_core import IoOp, PoolName, PoolTransfer
from tests.reliability._util import hex_hash

PAGES = 16


def main() -> dict[str, object]:
    from hicache_mooncake.testing import MooncakeMaster

    rng = random.Random(3)
    with MooncakeMaster() as master:
        opts = {
            "master_server_address": master.address,
            "local_hostname": "127.0.0.1",
            "global_segment_size": "64MB",
            "local_buffer_size": "16MB",
            "load_env": False,
        }
        kv = hc.MHAKVPool(2 * PAGES, 16, 4, 2, 64, allocate=False)
        cfg = hc.StorageConfig(backend="mooncake", options=opts, model_name=f"corrupt-{time.time_ns()}")
        with hc.CacheController(cfg, hc.HostPoolGroup(kv)) as ctl:
            for b in kv.buffers():
                b.copy_(
                    torch.randint(
                        0, 256, b.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
                    )
                )
            hashes = [hex_hash("mc-corrupt", i) for i in range(PAGES)]
            assert ctl.backup(hashes, range(PAGES)).pages == PAGES
            raw = ctl.store.backend.link.store  # type: ignore[attr-defined]
            keys = ctl.store.page_keys(PoolName.KV, hashes)
            victims = rng.sample(range(PAGES), PAGES // 3)
            for i in victims:
                key = keys[i][rng.randrange(2)]
                desc = raw.get_replica_desc(key)[0].get_memory_descriptor().buffer_descriptor
                cell = (ctypes.c_uint8 * desc.size).from_address(desc.buffer_address)
                cell[rng.randrange(desc.size)] ^= 1 << rng.randrange(8)
            for b in kv.buffers():
                b[PAGES:].zero_()
            transfer = PoolTransfer(
                PoolName.KV, tuple(range(PAGES, 2 * PAGES)), tuple(hashes), keys=tuple(keys)
            )
            (got,) = ctl.store.batch_io_v2(IoOp.GET, [transfer])
            intact = [all(torch.equal(b[PAGES + i], b[i]) for b in kv.buffers()) for i in range(PAGES)]
            integrity = getattr(ctl.store.backend, "integrity_errors", None)
    return {
        "pages": PAGES,
        "injected": len(victims),
        "detected": sum(1 for i in victims if not got[i]),
        "returned_as_data": sum(1 for i in range(PAGES) if got[i] and not intact[i]),
        "intact_reported_ok": sum(1 for i in range(PAGES) if i not in victims and got[i]),
        "integrity_errors_counted": integrity,
    }


if __name__ == "__main__":
    print(json.dumps(main()))
