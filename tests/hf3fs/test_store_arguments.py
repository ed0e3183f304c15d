"""Store.batch_io_v1 names the caller's mistake: a str as keys, a buffer that is not a tensor
(ArgumentTypeError, a TypeError), not a plugin error wrapping an AttributeError."""

from __future__ import annotations

import numpy as np
import pytest
from hf3fs_util import config

import hicache_core as hc
from hicache_core import IoOp, PoolName


def test_v1_arguments_of_the_wrong_type(tmp_path) -> None:
    store = hc.open_store(config(tmp_path))
    try:
        pool = hc.MHAKVPool(num_pages=2, page_size=4, num_layers=1, num_heads=1, head_dim=8)
        store.register_pool(PoolName.KV, pool)
        (keys,) = store.page_keys(PoolName.KV, hc.page_hashes(list(range(4)), page_size=4))
        with pytest.raises(hc.ArgumentTypeError, match="wrap a single key in a list"):
            store.batch_io_v1(IoOp.EXISTS, keys[0])
        views = list(pool.page_views([0])[0])
        assert store.batch_io_v1(IoOp.SET, list(keys), views) == [True] * len(keys)
        size = pool.component_nbytes[0]
        for bad in (b"\0" * size, bytearray(size), np.zeros(size, np.uint8), None, 7):
            with pytest.raises(hc.ArgumentTypeError, match=r"buffers\[0\] is a") as info:
                store.batch_io_v1(IoOp.GET, keys[:1], [bad])
            assert isinstance(info.value, TypeError)
    finally:
        store.close()
