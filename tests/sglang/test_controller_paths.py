"""The adapter driven by SGLang's own ``HiCacheController`` storage call sites.

``sglang.srt.managers.cache_controller`` cannot be imported here (it needs the GPU host-pool
stack), so its page-transfer methods are compiled from SGLang's source onto a minimal controller
object (see ``sglang_pools.sglang_methods``): ``_page_backup`` (batching by
``STORAGE_BATCH_SIZE``, stopping at the first failed batch), the zero-copy pair used with
``interface_v1`` (``_page_set_zero_copy`` / ``_page_get_zero_copy``) and the generic flat-page pair
(``_generic_page_set`` / ``_generic_page_get``). ``StorageOperation`` and ``PrefetchOperation``
are SGLang's classes, compiled the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageExtraInfo
from sglang_pools import MHAHost, fill_random, page_bytes, sglang_classes, sglang_methods

from hicache_core import page_hashes

CONTROLLER = "srt/managers/cache_controller.py"
_NS = {
    "STORAGE_BATCH_SIZE": STORAGE_BATCH_SIZE,
    "HiCacheStorageExtraInfo": HiCacheStorageExtraInfo,
    "logger": logging.getLogger("sglang.test.cache_controller"),
    "threading": threading,
    "time": time,
}
OPS = sglang_classes(CONTROLLER, ["StorageOperation", "PrefetchOperation"], _NS)


class Controller:
    """The attributes of ``HiCacheController`` that its storage page methods read."""

    def __init__(self, backend: Any, pool: Any, zero_copy: bool) -> None:
        self.storage_backend = backend
        self.storage_host_pool = self.mem_pool_host = pool
        self.page_size = pool.page_size
        self.page_get_func = self._page_get_zero_copy if zero_copy else self._generic_page_get
        self.page_set_func = self._page_set_zero_copy if zero_copy else self._generic_page_set


for _name, _fn in sglang_methods(
    CONTROLLER,
    "HiCacheController",
    ["_page_backup", "_page_get_zero_copy", "_page_set_zero_copy", "_generic_page_get", "_generic_page_set"],
    _NS,
).items():
    setattr(Controller, _name, _fn)


def _idx(pages: list[int], ps: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages]).to(torch.int64)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["interface_v1", "generic"])
def test_sglang_backup_and_prefetch_call_sites(make_adapter: Any, zero_copy: bool) -> None:
    ps, n = 2, STORAGE_BATCH_SIZE + 9  # more than one storage batch
    pool = MHAHost(2 * n + 4, ps, layer_num=2, head_num=1, head_dim=8)
    fill_random(pool, 41)
    extra = {} if zero_copy else {"interface_v1": 0}
    ctl = Controller(make_adapter(pool, extra=extra), pool, zero_copy)
    tokens = list(range(5000, 5000 + n * ps))
    hashes = page_hashes(tokens, ps)
    src = list(range(n))
    want = [page_bytes(pool, p) for p in src]

    backup = OPS["StorageOperation"](_idx(src, ps), tokens, hash_value=hashes, prefix_keys=[])
    ctl._page_backup(backup)
    assert backup.completed_tokens == n * ps
    assert ctl.storage_backend.batch_exists(hashes) == n

    dst = list(range(n, 2 * n))
    prefetch = OPS["PrefetchOperation"]("req-1", tokens)
    for start in range(0, n, STORAGE_BATCH_SIZE):
        batch = hashes[start : start + STORAGE_BATCH_SIZE]
        host = _idx(dst[start : start + len(batch)], ps)
        assert ctl.page_get_func(prefetch, batch, host, HiCacheStorageExtraInfo()) == len(batch)
    assert [page_bytes(pool, p) for p in dst] == want

    # A miss in the middle: SGLang counts the leading successes only.
    holes = [hashes[0], page_hashes([1, 2], ps)[0], hashes[2]]
    assert ctl.page_get_func(prefetch, holes, _idx([2 * n, 2 * n + 1, 2 * n + 2], ps)) == 1
