"""The controller's one-batch path (``hicache_core._one_batch``) gives the general path's results.

Two controllers on the same backend kind and the same pool contents, one forced onto the general
path, run the same requests; their results and the bytes they restore must be identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_core import CacheController, MHAKVPool, MLAKVPool, StorageConfig, page_hashes
from tests.support import membackend

BATCH = 8
FAILURES: list[dict[str, Any]] = [
    {},
    {"raise_ops": ["exists"]},
    {"raise_ops": ["set"]},
    {"raise_ops": ["get"]},
    {"fail_every": 3},
]


def _controller(backend: str, options: dict[str, Any], name: str, general: bool) -> CacheController:
    cfg = StorageConfig(backend=backend, options=options, model_name=name, batch_pages=BATCH)
    ctl = CacheController(cfg, MHAKVPool(16, 2, 1, 1, 4))
    if general:
        ctl._one_batch = ctl._one_batch_backup = False
    else:
        assert ctl._one_batch and ctl._one_batch_backup
    return ctl


def _fill(ctl: CacheController, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for b in ctl.pools.anchor.buffers():
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen).view(b.dtype))


@pytest.mark.usefixtures("memory_backends")
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    backend=st.sampled_from(["memory", "memory-skip"]),
    failure=st.sampled_from(range(len(FAILURES))),
    n=st.integers(1, BATCH + 2),
    stored=st.lists(st.booleans(), min_size=BATCH + 2, max_size=BATCH + 2),
    slots=st.permutations(range(16)),
    seed=st.integers(0, 2**16),
)
def test_one_batch_matches_the_general_path(
    backend: str, failure: int, n: int, stored: list[bool], slots: list[int], seed: int
) -> None:
    membackend.SHARED.clear()
    hashes = page_hashes(list(range(seed, seed + 2 * n)), 2)
    idx = slots[:n]
    results = []
    for general in (False, True):
        name = f"one-batch-{general}"
        # Pre-store a subset through a healthy general-path controller of the same namespace.
        with _controller(backend, {}, name, general=True) as pre:
            _fill(pre, seed)
            keep = [i for i in range(n) if stored[i]]
            if keep:
                assert pre.backup([hashes[i] for i in keep], [idx[i] for i in keep]).ok
        with _controller(backend, FAILURES[failure], name, general) as ctl:
            _fill(ctl, seed + 1)  # other bytes: a skipped page must keep its stored bytes
            if not general and n <= BATCH:
                ctl._prepare = None  # type: ignore[assignment,method-assign]  # the one-batch path must not plan
            backup = ctl.backup(hashes, idx)
            for b in ctl.pools.anchor.buffers():
                b.zero_()
            prefetch = ctl.prefetch(hashes, idx)
            restored = [b.clone() for b in ctl.pools.anchor.buffers()]
        results.append((backup, prefetch, restored))
    (b1, p1, r1), (b2, p2, r2) = results
    assert b1 == b2
    assert p1 == p2
    assert all(torch.equal(x, y) for x, y in zip(r1, r2))


@pytest.mark.usefixtures("memory_backends")
def test_requests_the_one_batch_path_does_not_take() -> None:
    """Larger batches, extra pools, async prefetch and non-writing ranks use the general path."""
    membackend.SHARED.clear()
    hashes = page_hashes(list(range(2 * (BATCH + 1))), 2)
    with _controller("memory", {}, "fallback", general=False) as ctl:
        calls: list[str] = []
        real = ctl._prepare

        def spy(kind: str, *args: Any, **kwargs: Any) -> Any:
            calls.append(kind)
            return real(kind, *args, **kwargs)

        ctl._prepare = spy  # type: ignore[method-assign]
        assert ctl.backup(hashes, range(BATCH + 1)).pages == BATCH + 1
        assert ctl.prefetch(hashes, range(BATCH + 1)).pages == BATCH + 1
        assert ctl.prefetch_async(hashes[:2], range(2)).result().pages == 2
        assert calls == ["backup", "prefetch", "prefetch"]
        calls.clear()
        assert ctl.backup(hashes[:2], range(2)).pages == 2
        assert ctl.prefetch([], []).pages == 0  # empty requests too
        assert calls == ["prefetch"]
    cfg = StorageConfig(backend="memory", model_name="mla", is_mla_model=True, tp_rank=1, tp_size=2)
    with CacheController(cfg, MLAKVPool(4, 2, 1, 8)) as mla:
        assert mla._one_batch and not mla._one_batch_backup  # rank 1 does not write replicated pages
        result = mla.backup(hashes[:2], range(2))
        assert result.pages == 2 and result.skipped == 2
