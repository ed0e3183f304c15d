"""The ``metrics`` extension: Prometheus exposition checked against the bytes actually moved."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

import hicache_core as hc
from hicache_core import CacheController, HostPoolGroup, IndexerPool, MambaPool, MHAKVPool, PoolName
from hicache_core.extensions.metrics import MetricsExtension, format_summary, start_exporter

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.timeout(120)

HAVE_FILE = importlib.util.find_spec("hicache_file") is not None


def metrics_of(store: hc.Store) -> MetricsExtension:
    ext = store.extensions["metrics"]
    assert isinstance(ext, MetricsExtension)
    return ext


def scrape(ext: MetricsExtension) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = prometheus_client.generate_latest(ext.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("backend", "store")))
            out[s.name, labels] = s.value
    return out


def group() -> HostPoolGroup:
    kv = MHAKVPool(48, 4, 2, 2, 8, allocate=False)
    return HostPoolGroup(
        kv,
        {
            PoolName.MAMBA: MambaPool(4, 2, (4, 4), [(3, 4)], allocate=False),
            PoolName.INDEXER: IndexerPool(48, 4, 2, 8, allocate=False),
        },
    )


def fill(g: HostPoolGroup, seed: int = 3) -> None:
    gen = torch.Generator().manual_seed(seed)
    for pool in g.values():
        for b in pool.buffers():
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def backend_cases() -> list[Any]:
    cases: list[Any] = ["memory", "memory-zc", "memory-nodraft"]
    cases.append(
        pytest.param("file", marks=pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed"))
    )
    return cases


@pytest.mark.parametrize("backend", backend_cases())
def test_exposition_matches_bytes_moved(memory_backends, tmp_path: Path, backend: str) -> None:
    options = {"root": str(tmp_path / "root")} if backend == "file" else {}
    g = group() if backend != "memory-nodraft" else HostPoolGroup(MHAKVPool(48, 4, 2, 2, 8, allocate=False))
    cfg = hc.StorageConfig(backend=backend, options=options, extensions=["metrics"], batch_pages=8)
    n = 20
    hashes = hc.page_hashes(list(range(4 * n)), 4)
    with CacheController(cfg, g) as ctl:
        ext = metrics_of(ctl.store)
        fill(g)
        extra = {PoolName.MAMBA: [1]} if PoolName.MAMBA in g else None
        assert ctl.backup(hashes, range(n), extra).pages == n
        res = ctl.prefetch(hashes, range(n, 2 * n), extra)
        assert res.pages == n
        moved = {name: len(flags) for name, flags in res.per_pool.items()}  # pages read per pool
        samples = scrape(ext)
        snap = ext.snapshot()
    print(f"\n[metrics:{backend}] path={ctl.io_path} snapshot totals={snap['totals']}")
    for name, pool in g.items():
        written = 1 if name is PoolName.MAMBA else n
        labels_w = (("direction", "write"), ("pool", name.value))
        labels_r = (("direction", "read"), ("pool", name.value))
        assert samples["hicache_storage_pages_total", labels_w] == written
        assert samples["hicache_storage_bytes_total", labels_w] == written * pool.page_nbytes
        assert samples["hicache_storage_pages_total", labels_r] == moved[name]
        assert samples["hicache_storage_bytes_total", labels_r] == moved[name] * pool.page_nbytes
        assert snap["pools"][name.value]["bytes_written"] == written * pool.page_nbytes
    total = sum(p.page_nbytes * (1 if k is PoolName.MAMBA else n) for k, p in g.items())
    assert snap["totals"]["bytes_written"] == total
    assert samples["hicache_storage_exists_calls_total", ()] >= 1
    path = ctl.io_path
    assert samples["hicache_storage_io_seconds_count", (("op", "get"), ("path", path))] >= 1
    assert samples["hicache_storage_io_seconds_bucket", (("le", "+Inf"), ("op", "set"), ("path", path))] >= 1
    assert snap["internal_errors"] == 0
    json.dumps(snap)  # JSON-ready


def test_hits_misses_and_errors_by_type(memory_backends) -> None:
    g = HostPoolGroup(MHAKVPool(16, 4, 1, 1, 8, allocate=False))
    hashes = hc.page_hashes(list(range(40)), 4)
    cfg = hc.StorageConfig(backend="memory", extensions=["metrics"])
    with CacheController(cfg, g) as ctl:
        ext = metrics_of(ctl.store)
        ctl.backup(hashes[:4], range(4))
        before = ext.snapshot()["pools"]["kv"]
        assert ctl.query(hashes).pages == 4
        kv = ext.snapshot()["pools"]["kv"]
        assert kv["exists_hits"] - before["exists_hits"] == 4
        assert kv["exists_misses"] - before["exists_misses"] == 6
    bad = hc.StorageConfig(backend="memory-nodraft", extensions=["metrics"], options={"raise_on": ["get"]})
    with CacheController(bad, HostPoolGroup(MHAKVPool(16, 4, 1, 1, 8, allocate=False))) as ctl:
        ext = metrics_of(ctl.store)
        res = ctl.prefetch(hashes[:4], range(4))
        assert res.pages == 0 and res.errors
        samples = scrape(ext)
    assert samples["hicache_storage_errors_total", (("op", "get"), ("type", "RuntimeError"))] == 1
    assert ext.snapshot()["errors"] == {"get": {"RuntimeError": 1}}


def test_enable_storage_metrics_flag(memory_backends) -> None:
    with hc.open_store(hc.StorageConfig(backend="memory", enable_storage_metrics=True)) as store:
        assert isinstance(store.extensions["metrics"], MetricsExtension)


def _draft_group() -> HostPoolGroup:
    return HostPoolGroup(
        MHAKVPool(8, 4, 1, 1, 8, allocate=False), {PoolName.DRAFT: MHAKVPool(8, 4, 1, 1, 8, allocate=False)}
    )


@pytest.mark.parametrize(
    ("backend", "split", "enabled", "reason"),
    [
        ("memory", False, True, "memory backend"),
        ("memory-zc", False, True, "memory backend"),
        ("memory-zc", True, False, "split heads"),
        ("memory-nodraft", False, False, "memory backend"),
    ],
)
@pytest.mark.filterwarnings("ignore::hicache_core.DraftOffloadDisabledWarning")
def test_draft_offload_state(memory_backends, backend: str, split: bool, enabled: bool, reason: str) -> None:
    cfg = hc.StorageConfig(backend=backend, extensions=["metrics"], should_split_heads=split)
    with CacheController(cfg, _draft_group()) as ctl:
        ext = metrics_of(ctl.store)
        assert ctl.draft_enabled is enabled
        state = ext.snapshot()["draft"]
        samples = scrape(ext)
    assert state["enabled"] is enabled
    assert reason in state["reason"]
    (value,) = [v for (name, _), v in samples.items() if name == "hicache_storage_draft_offload_enabled"]
    assert value == (1.0 if enabled else 0.0)


def test_integrity_errors_read_from_backend(memory_backends) -> None:
    with hc.open_store(hc.StorageConfig(backend="memory", extensions=["metrics"])) as store:
        ext = metrics_of(store)
        assert ext.snapshot()["integrity_errors"] is None  # the memory backend does not verify
        store.backend.integrity_errors = 3
        assert ext.snapshot()["integrity_errors"] == 3
        assert scrape(ext)["hicache_storage_integrity_errors_total", ()] == 3


def test_missing_prometheus_client_is_a_typed_error(memory_backends, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(hc.BackendUnavailableError, match=r"hicache-core\[metrics\]"):
        hc.open_store(hc.StorageConfig(backend="memory", extensions=["metrics"]))


def test_standalone_exporter_serves_every_store(memory_backends) -> None:
    port = start_exporter(0)
    assert start_exporter(0) == port  # once per process and address
    g = HostPoolGroup(MHAKVPool(8, 4, 1, 1, 8, allocate=False))
    with CacheController(hc.StorageConfig(backend="memory", extensions=["metrics"]), g) as ctl:
        ctl.backup(hc.page_hashes(list(range(8)), 4), range(2))
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    store_id = ctl.store.extensions["metrics"].store_id  # type: ignore[attr-defined]
    assert (
        f'hicache_storage_pages_total{{backend="memory",direction="write",pool="kv",store="{store_id}"}} 2.0'
        in body
    )


def test_exporter_port_env_is_validated(memory_backends, monkeypatch) -> None:
    monkeypatch.setenv("HICACHE_METRICS_PORT", "not-a-port")
    with pytest.raises(hc.ConfigError, match="HICACHE_METRICS_PORT"):
        hc.open_store(hc.StorageConfig(backend="memory", extensions=["metrics"]))


def test_summary_lines(memory_backends) -> None:
    g = HostPoolGroup(MHAKVPool(8, 4, 1, 1, 8, allocate=False))
    with CacheController(hc.StorageConfig(backend="memory", extensions=["metrics"]), g) as ctl:
        hs = hc.page_hashes(list(range(8)), 4)
        ctl.backup(hs, range(2))
        assert ctl.query(hs).pages == 2
        ctl.prefetch(hs, range(2, 4))
        lines = format_summary(ctl.store.extensions["metrics"].snapshot())  # type: ignore[attr-defined]
    text = "\n".join(lines)
    assert "hit rate 50.0%" in text and "latency get/v2" in text  # backup misses 2, the query hits 2
    assert "p99 " in text


def test_trace_logs_every_hook_call(memory_backends, monkeypatch, caplog) -> None:
    monkeypatch.setenv("HICACHE_TRACE", "1")
    caplog.set_level(logging.INFO, logger="hicache.trace")
    g = HostPoolGroup(MHAKVPool(16, 4, 1, 1, 8, allocate=False))
    with CacheController(hc.StorageConfig(backend="memory-nodraft", extensions=["metrics"]), g) as ctl:
        ctl.backup(hc.page_hashes(list(range(20)), 4), range(5))
    records = [r.getMessage() for r in caplog.records if r.name == "hicache.trace"]
    print("\n" + "\n".join(records))
    io = [m for m in records if m.startswith("hicache_batch_io_v1")]
    assert len(io) == 2  # exists, then set
    for m in io:
        assert "plugins=[" in m and "backend:memory-nodraft" in m and "extension:metrics" in m
        assert "batch=10" in m  # 5 pages x (k, v)
        assert m.rstrip().endswith("us")
    assert any(m.startswith("hicache_register_pool") for m in records)
    assert any(m.startswith("hicache_page_keys") and "batch=5" in m for m in records)


def test_v1_counts_the_pool_the_call_names(memory_backends) -> None:
    """A v1 call is counted for its ``pool_name`` whatever its keys look like, at the pool's
    component sizes; a page is done only when every one of its components is."""
    kv = MHAKVPool(4, 4, 1, 1, 8)  # (k, v), 64 bytes each
    idx = IndexerPool(4, 4, 1, 4)  # one component, 16 bytes
    k0, v0, k1, v1 = [v for page in kv.page_views(range(2)) for v in page]
    with hc.open_store(hc.StorageConfig(backend="memory", extensions=["metrics"])) as store:
        ext = metrics_of(store)
        store.register_pool(PoolName.KV, kv)
        store.register_pool(PoolName.INDEXER, idx)
        assert (
            store.batch_io_v1("set", ["a.k", "a.v", "b.k", "b.v"], [k0, v0, k1, v1], PoolName.KV)
            == [True] * 4
        )
        ix_views = [v for page in idx.page_views(range(2)) for v in page]
        store.batch_io_v1("set", ["x.kv.k.0.a", "x.kv.k.0.b"], ix_views, PoolName.INDEXER)  # kv-like keys
        # page 0 whole; page 1 lacks its v, page 2 its k: 1 page done, 4 components (256 bytes) read
        got = store.batch_io_v1(
            "get", ["a.k", "a.v", "b.k", "missing.v", "missing.k", "b.v"], [k0, v0, k1, v1, k0, v0]
        )
        assert got == [True, True, True, False, False, True]
        assert store.batch_io_v1("exists", ["a.k", "a.v", "b.k", "missing.v"]) == [True, True, True, False]
        pools = ext.snapshot()["pools"]
    assert pools["kv"]["pages_written"] == 2 and pools["kv"]["bytes_written"] == 4 * 64
    assert pools["indexer"]["pages_written"] == 2 and pools["indexer"]["bytes_written"] == 2 * 16
    assert pools["kv"]["pages_read"] == 1 and pools["kv"]["failed_get"] == 2
    assert pools["kv"]["bytes_read"] == 4 * 64
    assert (pools["kv"]["exists_hits"], pools["kv"]["exists_misses"]) == (1, 1)
    assert ext.snapshot()["internal_errors"] == 0


def test_v1_keys_that_are_not_whole_pages(memory_backends) -> None:
    """Keys that are not whole pages of a registered pool count one page per key, at the size of
    its buffer."""
    kv = MHAKVPool(4, 4, 1, 1, 8)
    k0, v0 = kv.page_views([0])[0]
    with hc.open_store(hc.StorageConfig(backend="memory", extensions=["metrics"])) as store:
        ext = metrics_of(store)
        store.register_pool(PoolName.KV, kv)
        store.batch_io_v1("set", ["c.k", "c.v", "d.k"], [k0, v0, k0], PoolName.KV)  # 1.5 pages
        store.batch_io_v1("set", ["m"], [torch.zeros(10, dtype=torch.uint8)], PoolName.MAMBA)  # unregistered
        pools = ext.snapshot()["pools"]
    assert (pools["kv"]["pages_written"], pools["kv"]["bytes_written"]) == (3, 3 * 64)
    assert (pools["mamba"]["pages_written"], pools["mamba"]["bytes_written"]) == (1, 10)


class _Answer:
    """Answers every v1 call before the backend with ``answer(len(keys))``."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    @hc.hookimpl(tryfirst=True)
    def hicache_batch_io_v1(self, keys: list[str]) -> Any:
        return self.answer(len(keys))


def test_v1_results_counted_as_the_store_takes_them(memory_backends) -> None:
    """A wrong-length result is a ``BackendContractError``; a tuple of bools is counted."""
    with hc.open_store(hc.StorageConfig(backend="memory", extensions=["metrics"])) as store:
        ext = metrics_of(store)
        store.pm.register(_Answer(lambda n: [True] * (n - 1)), name="short")
        with pytest.raises(hc.BackendContractError):
            store.batch_io_v1("exists", ["a", "b"])
        store.pm.unregister(name="short")
        store.pm.register(_Answer(lambda n: (True,) * n), name="tuple")
        assert store.batch_io_v1("exists", ["a", "b"]) == [True, True]
        snap = ext.snapshot()
    assert snap["errors"] == {"exists": {"BackendContractError": 1}}
    assert snap["pools"]["kv"]["exists_hits"] == 2 and snap["exists_calls"] == 1
    assert snap["latency"]["exists/v1"]["count"] == 2
