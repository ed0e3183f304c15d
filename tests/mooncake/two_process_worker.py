"""One side of the two-process test, run in a FRESH interpreter.

``backup``: build a hybrid KV + Mamba + draft group in store-owned memory, fill it from a seed,
back everything up through the CacheController, print a JSON summary and exit.
``verify``: build the same group, query, prefetch into different slots and compare every byte
with the bytes regenerated from the seed. Exit status 0 only when everything matched.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mooncake_helpers import expect_same_pages, fill, make_group, rand_hashes, snapshot, zero

from hicache_core import CacheController, PoolName, StorageConfig


def main(action: str, options_json: str, seed: int, n: int) -> int:
    cfg = StorageConfig(backend="mooncake", options=json.loads(options_json), model_name=f"two-proc-{seed}")
    group = make_group("hybrid", pages=n + 8)
    hashes = rand_hashes(n, seed=seed)
    src = list(range(n))
    with CacheController(cfg, group) as ctl:
        assert ctl.io_path == "v2" and ctl.draft_enabled
        if action == "backup":
            fill(group, seed)
            res = ctl.backup(hashes, src, {PoolName.MAMBA: [0, 1]})
            print(json.dumps({"pid": os.getpid(), "pages": res.pages, "ok": res.ok, "draft": res.draft}))
            return 0 if res.ok and res.pages == n and res.draft == [True] * n else 1
        expected = make_group("hybrid", pages=n + 8, allocate=True)
        fill(expected, seed)
        ref = snapshot(expected)
        zero(group)
        q = ctl.query(hashes)
        dst = [n + 7 - i for i in range(n)]
        got = ctl.prefetch(hashes, dst, {PoolName.MAMBA: [4, 5]})
        assert q.pages == n and got.pages == n and got.ok and got.draft == [True] * n, (q, got)
        expect_same_pages(ref, group, PoolName.KV, src, dst)
        expect_same_pages(ref, group, PoolName.DRAFT, src, dst)
        expect_same_pages(ref, group, PoolName.MAMBA, [0, 1], [4, 5])
        nbytes = sum(p.page_nbytes for p in group.values())
        print(json.dumps({"pid": os.getpid(), "pages": got.pages, "verified_page_bytes": nbytes * n}))
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
