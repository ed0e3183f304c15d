"""A misbehaving third-party backend: the controller reports it per page, bounds it, keeps serving.

The backend is a real throwaway distribution (entry point ``rogue``/``rogue-v1``) whose hooks
raise, return ``None``, return too few / too many results or non-bools, or block. With
``io_timeout_s`` set, every operation must come back within a bound, report every page failed
with the plugin named, never report a page loaded that was not, and the same controller must
work again once the backend behaves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hicache_core as hc
from hicache_core import CacheController, HostPoolGroup, MHAKVPool, PoolName
from tests.reliability._util import report
from tests.support.distinfo import installed_dist

pytestmark = pytest.mark.timeout(120)

ROGUE = """
import threading
from pydantic import BaseModel, ConfigDict
from hicache_core import Capabilities, DraftIo, DraftIoMode, IoOp, hookimpl

RELEASE = threading.Event()
DATA = {}


class Rogue:
    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mode: str = "ok"
        ops: list[str] = ["exists", "get", "set"]

    capabilities = Capabilities(v1=True, v2=True, draft_io=DraftIoMode.UNSUPPORTED)

    def __init__(self, config, options):
        self.mode = options.mode
        self.ops = set(options.ops)
        self.pools = {}

    @hookimpl
    def hicache_register_pool(self, pool_name, pool):
        self.pools[pool_name] = pool

    @hookimpl
    def hicache_draft_io_capability(self):
        return DraftIo(DraftIoMode.UNSUPPORTED, "rogue")

    def _bad(self, op, n):
        mode = self.mode if str(op) in self.ops else "ok"
        if mode == "raise":
            raise RuntimeError("rogue backend exploded")
        if mode == "keyerror":
            raise KeyError("rogue-missing")
        if mode == "none":
            return None
        if mode == "short":
            return [True] * max(0, n - 1)
        if mode == "long":
            return [True] * (n + 1)
        if mode == "nonbool":
            return [1] * n
        if mode == "block":
            RELEASE.wait(60)
            return [True] * n
        return "ok"

    def _io(self, op, keys, views):
        out = []
        for i, k in enumerate(keys):
            if op is IoOp.EXISTS:
                out.append(k in DATA)
            elif op is IoOp.SET:
                DATA[k] = views[i].contiguous().clone()
                out.append(True)
            elif k in DATA:
                views[i].copy_(DATA[k].view(views[i].shape))
                out.append(True)
            else:
                out.append(False)
        return out

    @hookimpl
    def hicache_batch_io_v1(self, op, keys, buffers):
        bad = self._bad(op, len(keys))
        return self._io(op, keys, buffers) if bad == "ok" else bad

    @hookimpl
    def hicache_batch_io_v2(self, op, transfers):
        bad = self._bad(op, len(transfers))
        if bad != "ok":
            return bad
        out = []
        for t in transfers:
            views = self.pools[t.pool].page_views(t.host_indices) if op is not IoOp.EXISTS else [None] * len(t)
            out.append([all(self._io(op, ks, v)) for ks, v in zip(t.keys, views)])
        return out


class RogueV1(Rogue):
    capabilities = Capabilities(v1=True, v2=False, draft_io=DraftIoMode.UNSUPPORTED)
"""

MODES = ["raise", "keyerror", "none", "short", "long", "nonbool", "block"]
TIMEOUT = 0.5


@pytest.fixture
def rogue(tmp_path: Path) -> Iterator[object]:
    eps = {"hicache.backends": {"rogue": "hicache_rogue:Rogue", "rogue-v1": "hicache_rogue:RogueV1"}}
    with installed_dist(tmp_path / "site", "hicache-rogue", eps, {"hicache_rogue": ROGUE}):
        import hicache_rogue  # type: ignore[import-not-found]

        hicache_rogue.RELEASE.clear()
        hicache_rogue.DATA.clear()
        yield hicache_rogue
        hicache_rogue.RELEASE.set()  # free abandoned calls


@pytest.mark.parametrize("backend", ["rogue", "rogue-v1"])
@pytest.mark.parametrize("mode", MODES)
def test_misbehaving_backend_is_reported_bounded_and_survived(
    rogue, backend: str, mode: str, record_property
) -> None:
    kv = MHAKVPool(16, 4, 1, 1, 8, allocate=False)
    cfg = hc.StorageConfig(
        backend=backend, options={"mode": mode}, extensions=["metrics"], io_timeout_s=TIMEOUT
    )
    hashes = hc.page_hashes(list(range(32)), 4)
    with CacheController(cfg, HostPoolGroup(kv)) as ctl:
        for b in kv.buffers():
            b.copy_(torch.arange(b.numel(), dtype=torch.int64).remainder(251).to(torch.uint8).view(b.shape))
        timings = {}
        t0 = time.monotonic()
        res = ctl.backup(hashes, range(8))
        timings["backup"] = time.monotonic() - t0
        t0 = time.monotonic()
        q = ctl.query(hashes)
        timings["query"] = time.monotonic() - t0
        t0 = time.monotonic()
        pre = ctl.prefetch(hashes, range(8, 16))
        timings["prefetch"] = time.monotonic() - t0
        fut = ctl.backup_async(hashes, range(8))
        res_async = fut.result(timeout=10)
        errors = res.errors + q.errors + pre.errors
        # every page failed, the plugin is named, nothing is reported loaded
        assert res.pages == 0 and not any(res.per_pool[PoolName.KV])
        assert q.pages == 0 and pre.pages == 0 and res_async.pages == 0
        assert errors and all(f"backend {backend!r}" in e for e in errors)
        kind = "BackendTimeoutError" if mode == "block" else ("RuntimeError" if mode == "raise" else None)
        if kind is not None:
            assert all(kind in e for e in res.errors)
        elif mode != "keyerror" and (backend, mode) != ("rogue", "nonbool"):  # that one: see below
            assert all("BackendContractError" in e for e in res.errors)
        # bounded: an operation makes at most two backend calls (exists, then set/get)
        assert max(timings.values()) < 2 * TIMEOUT + 1.5, timings
        # keeps serving once the backend behaves
        rogue.RELEASE.set()  # type: ignore[attr-defined]
        ctl.store.backend.mode = "ok"
        ok = ctl.backup(hashes, range(8))
        assert ok.pages == 8 and ok.ok
        assert ctl.prefetch(hashes, range(8, 16)).pages == 8
        assert torch.equal(kv.buffers()[0][8:16], kv.buffers()[0][0:8])
        snap = ctl.store.extensions["metrics"].snapshot()  # type: ignore[attr-defined]
    counted = sum(sum(v.values()) for v in snap["errors"].values())
    report(
        record_property,
        f"misbehaviour-{backend}-{mode}",
        errors_reported=len(errors),
        metric_errors=counted,
        **{f"{k}_s": round(v, 3) for k, v in timings.items()},
    )
    if mode != "block":  # a blocked call is abandoned, so the wrapper only sees it once it returns
        assert counted >= 1


def test_abandoned_calls_do_not_starve_the_controller(rogue) -> None:
    """Many timed-out calls in a row: the controller still answers within the bound each time."""
    kv = MHAKVPool(16, 4, 1, 1, 8, allocate=False)
    cfg = hc.StorageConfig(backend="rogue", options={"mode": "block", "ops": ["exists"]}, io_timeout_s=0.2)
    hashes = hc.page_hashes(list(range(32)), 4)
    with CacheController(cfg, HostPoolGroup(kv)) as ctl:
        t0 = time.monotonic()
        for _ in range(30):  # more stuck calls than the controller's call pool has threads (12)
            assert ctl.query(hashes).pages == 0
        elapsed = time.monotonic() - t0
        stuck = sum(1 for t in threading.enumerate() if t.name.startswith("hicache-call"))
        rogue.RELEASE.set()  # type: ignore[attr-defined]
    print(f"\n[reliability:abandoned-calls] 30 blocked queries in {elapsed:.2f}s, {stuck} call threads")
    assert elapsed < 30 * 0.2 + 5, f"timed-out calls queue behind each other: {elapsed:.1f}s"


def test_v2_result_of_non_lists_is_a_contract_error(rogue) -> None:
    kv = MHAKVPool(4, 4, 1, 1, 8)
    with hc.open_store(hc.StorageConfig(backend="rogue", options={"mode": "nonbool"})) as store:
        store.register_pool(PoolName.KV, kv)
        hashes = hc.page_hashes(list(range(8)), 4)
        keys = tuple(store.page_keys(PoolName.KV, hashes))
        transfer = hc.PoolTransfer(PoolName.KV, (0, 1), tuple(hashes), keys=keys)
        with pytest.raises(hc.BackendContractError, match="rogue"):
            store.batch_io_v2(hc.IoOp.EXISTS, [transfer])
