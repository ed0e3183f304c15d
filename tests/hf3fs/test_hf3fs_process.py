"""hf3fs across processes: fresh-process reads, SIGKILLed writers, crash points, live sharing.

Writers are forked from this process (no interpreter start-up per kill) and killed with
SIGKILL; ONE fresh interpreter then verifies every scenario (see ``VERIFY``), so a reader that
shares no state with any writer decides what is on disk.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf3fs_util import config, fill, pattern, run_python
from hicache_hf3fs_stub import _slotfile

from hicache_core import CacheController, IoOp, MHAKVPool, MLAKVPool, open_store, page_hashes

FORK = multiprocessing.get_context("fork")
PAGE = 64 << 10  # payload of the crash tests: big enough that a kill can land inside a write
N = 6

VERIFY = r"""
import json, sys, torch
from hicache_core import CacheController, IoOp, MHAKVPool, MLAKVPool, StorageConfig, open_store

spec = json.loads(sys.argv[1])

def pattern(key, nbytes):
    import hashlib
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]

def fill(pool, seed):
    for i, buf in enumerate(pool.buffers()):
        g = torch.Generator().manual_seed(seed * 1009 + i)
        buf.copy_(torch.randint(0, 256, tuple(buf.shape), dtype=torch.uint8, generator=g))

out = {}
for name, case in spec["kv"].items():
    store = open_store(StorageConfig(backend="hf3fs", options=case["options"]))
    keys, n = case["keys"], case["nbytes"]
    exists = store.batch_io_v1(IoOp.EXISTS, keys)
    # read every key the index has, plus up to 16 it does not (those must be misses too)
    absent = [k for k, e in zip(keys, exists) if not e][:16]
    probe = [k for k, e in zip(keys, exists) if e] + absent
    bufs = [torch.zeros(n, dtype=torch.uint8) for _ in probe]
    got = store.batch_io_v1(IoOp.GET, probe, bufs)
    res = {"hits": [], "wrong": [], "exists_unreadable": [], "absent_read": []}
    for k, b, ok in zip(probe, bufs, got):
        if ok:
            res["hits"].append(k)
            if b.numpy().tobytes() != pattern(k, n):
                res["wrong"].append(k)
            if k in absent:
                res["absent_read"].append(k)
        elif k not in absent:
            res["exists_unreadable"].append(k)
    # the file must stay writable after whatever the dead writer left behind
    probe = "probe.after-crash"
    res["probe_set"] = store.batch_io_v1(IoOp.SET, [probe], [torch.frombuffer(bytearray(pattern(probe, n)), dtype=torch.uint8)])[0]
    pb = torch.zeros(n, dtype=torch.uint8)
    res["probe_get"] = store.batch_io_v1(IoOp.GET, [probe], [pb])[0] and pb.numpy().tobytes() == pattern(probe, n)
    store.close()
    out[name] = res
for name, case in spec["controller"].items():
    cfg = StorageConfig(backend="hf3fs", **case["config"])
    make = MLAKVPool if cfg.is_mla_model else MHAKVPool
    want, got = make(*case["pool"], layout=cfg.layout), make(*case["pool"], layout=cfg.layout)
    fill(want, case["seed"])
    with CacheController(cfg, got) as ctl:
        r = ctl.prefetch(case["hashes"], list(range(len(case["hashes"]))))
    n = len(case["hashes"])
    same = all(torch.equal(a[:n] if cfg.layout.value == "page_first" else a[:, :n], b[:n] if cfg.layout.value == "page_first" else b[:, :n]) for a, b in zip(want.buffers(), got.buffers()))
    out[name] = {"pages": r.pages, "same": same}
print(json.dumps(out))
"""


# --------------------------------------------------------------------- writers (forked)
def _open(prefix: Path, num_slots: int):  # type: ignore[no-untyped-def]
    return open_store(config(prefix, options={"num_slots": num_slots, "bytes_per_page": PAGE}))


def _tensor(key: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(pattern(key, PAGE)), dtype=torch.uint8)


def _writer_loop(prefix: Path, start: int, progress: Any) -> None:
    store = _open(prefix, num_slots=12)
    i = start
    while True:
        keys = [f"crash.k{j}" for j in range(i, i + 4)]
        store.batch_io_v1(IoOp.SET, keys, [_tensor(k) for k in keys])
        i += 4
        progress.value = i


class _CrashingOs:
    """Stands in for ``os`` inside ``_slotfile``: SIGKILLs the process at one chosen write."""

    def __init__(self, point: str) -> None:
        self.point = point

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        if self.point == "mid-payload" and len(data) == PAGE:
            os.pwrite(fd, bytes(data[: PAGE // 2]), offset)
            self._die()
        if self.point == "before-header" and len(data) == _slotfile.HEADER_SIZE and data[4] == 1:
            self._die()  # payload written, its valid header not
        return os.pwrite(fd, data, offset)

    def write(self, fd: int, data: Any) -> int:
        if self.point == "before-put":
            self._die()
        if self.point == "torn-put":
            os.write(fd, bytes(data[: len(data) // 2]))
            self._die()
        return os.write(fd, data)


def _crash_writer(prefix: Path, point: str, seeds: list[str], target: list[str]) -> None:
    store = _open(prefix, num_slots=len(seeds) if point == "mid-payload" else 8)
    assert store.batch_io_v1(IoOp.SET, seeds, [_tensor(k) for k in seeds]) == [True] * len(seeds)
    _slotfile.os = _CrashingOs(point)  # type: ignore[assignment]
    store.batch_io_v1(IoOp.SET, target, [_tensor(k) for k in target])
    os._exit(3)  # not reached: the crash point kills us


def _run_forked(target: Callable[..., None], *args: Any) -> multiprocessing.process.BaseProcess:
    proc = FORK.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


# --------------------------------------------------------------------- the scenarios
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf3fs-proc")
    spec: dict[str, Any] = {"kv": {}, "controller": {}}
    facts: dict[str, Any] = {}
    t0 = time.monotonic()

    # 1. persistence through the controller (MHA page_first, MHA layer_first, MLA rank 1 of 2)
    hashes = page_hashes(list(range(4 * N)), 4)
    for name, fields, pool in [
        ("mha", {}, (8, 4, 2, 2, 8)),
        ("layer_first", {"layout": "layer_first"}, (8, 4, 2, 2, 8)),
        ("mla", {"is_mla_model": True, "tp_size": 2}, (8, 4, 2, 32)),
    ]:
        cfg = config(root / name, **fields)
        src = (MLAKVPool if cfg.is_mla_model else MHAKVPool)(*pool, layout=cfg.layout)  # type: ignore[arg-type]
        fill(src, 31)
        with CacheController(cfg, src) as ctl:
            assert ctl.backup(hashes, range(N)).ok
        reader = cfg.model_dump(mode="json", exclude={"controller"})
        reader.pop("backend")
        if name == "mla":
            reader["tp_rank"] = 1  # another rank, in another process, reads rank 0's file
        spec["controller"][name] = {"config": reader, "pool": pool, "seed": 31, "hashes": hashes}

    # 2. writers SIGKILLed at random moments, six times, on one file (with slot reuse)
    prefix = root / "sigkill"
    progress = FORK.Value("q", 0)
    rng = random.Random(7)
    last = 0
    for round_ in range(6):
        start = round_ * 1000
        progress.value = start
        proc = _run_forked(_writer_loop, prefix, start, progress)
        deadline = time.monotonic() + 30
        while progress.value < start + 8 and time.monotonic() < deadline and proc.is_alive():
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.03))
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        last = max(last, progress.value)
        facts.setdefault("committed", []).append(progress.value - start)
    keys = [
        f"crash.k{j}" for r, c in enumerate(facts["committed"]) for j in range(r * 1000, r * 1000 + c + 8)
    ]
    spec["kv"]["sigkill"] = {"options": _opts(prefix, 12), "keys": keys, "nbytes": PAGE}

    # 3. deterministic crash points
    seeds = ["seed.a", "seed.b", "seed.c"]
    for point in ("mid-payload", "before-header", "before-put", "torn-put"):
        prefix = root / point
        target = ["new.x", "new.y"]
        proc = _run_forked(_crash_writer, prefix, point, seeds, target)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, f"{point}: the writer was not killed at its crash point"
        slots = 3 if point == "mid-payload" else 8
        spec["kv"][point] = {"options": _opts(prefix, slots), "keys": seeds + target, "nbytes": PAGE}

    # 4. a page corrupted on disk behind the index's back (power loss without fsync, bit rot)
    prefix = root / "bitrot"
    store = _open(prefix, num_slots=4)
    store.batch_io_v1(IoOp.SET, ["rot.a", "rot.b"], [_tensor("rot.a"), _tensor("rot.b")])
    sf = store.backend._files["0"]
    off = sf.slot_offset(sf.slot_of("rot.a")) + _slotfile.HEADER_SIZE + 1234
    store.close()
    with open(f"{prefix}.0.bin", "r+b") as fh:
        fh.seek(off)
        byte = fh.read(1)
        fh.seek(off)
        fh.write(bytes([byte[0] ^ 0x40]))
    spec["kv"]["bitrot"] = {"options": _opts(prefix, 4), "keys": ["rot.a", "rot.b"], "nbytes": PAGE}

    facts["setup_s"] = time.monotonic() - t0
    results = run_python(VERIFY, json.dumps(spec), timeout=120)
    facts["total_s"] = time.monotonic() - t0
    print(facts)
    return {"results": results, "facts": facts}


def _opts(prefix: Path, slots: int) -> dict[str, Any]:
    return {"file_path_prefix": str(prefix), "num_slots": slots, "bytes_per_page": PAGE}


@pytest.mark.parametrize("name", ["mha", "layer_first", "mla"])
def test_fresh_process_prefetches_exact_bytes(world: dict[str, Any], name: str) -> None:
    assert world["results"][name] == {"pages": N, "same": True}


def test_sigkilled_writers_never_leave_torn_pages(world: dict[str, Any]) -> None:
    res = world["results"]["sigkill"]
    assert all(c >= 8 for c in world["facts"]["committed"]), world["facts"]
    assert res["wrong"] == []
    assert res["exists_unreadable"] == []  # an index entry always names a complete slot
    assert res["absent_read"] == []
    assert len(res["hits"]) >= 8  # the file kept the most recent committed pages
    assert res["probe_set"] and res["probe_get"]


@pytest.mark.parametrize("point", ["mid-payload", "before-header", "before-put", "torn-put"])
def test_crash_points_give_misses_never_wrong_bytes(world: dict[str, Any], point: str) -> None:
    res = world["results"][point]
    assert res["wrong"] == [] and res["exists_unreadable"] == [] and res["absent_read"] == []
    expected = {"seed.a", "seed.b", "seed.c"}
    if point == "torn-put":
        expected.add("new.x")  # the kill cut the 2-record batch after new.x's complete record
    if point == "mid-payload":
        # the file was full: both new pages reused the LRU slots (seed.a, seed.b), whose FREE
        # records are logged before any slot is overwritten
        expected -= {"seed.a", "seed.b"}
    assert set(res["hits"]) == expected
    assert res["probe_set"] and res["probe_get"]  # a torn index record is dropped, writes go on


def test_corrupted_slot_is_a_miss(world: dict[str, Any]) -> None:
    res = world["results"]["bitrot"]
    assert res["hits"] == ["rot.b"] and res["wrong"] == []
    assert res["exists_unreadable"] == ["rot.a"]  # the index still lists it; the CRC refuses it


def _child_writes(prefix: Path, keys: list[str]) -> None:
    store = _open(prefix, num_slots=16)
    ok = store.batch_io_v1(IoOp.SET, keys, [_tensor(k) for k in keys])
    store.close()
    os._exit(0 if all(ok) else 1)


def test_live_store_sees_pages_written_by_another_process(tmp_path: Path) -> None:
    prefix = tmp_path / "shared"
    store = _open(prefix, num_slots=16)
    keys = ["mine.0", "mine.1"]
    store.batch_io_v1(IoOp.SET, keys, [_tensor(k) for k in keys])
    theirs = [f"theirs.{i}" for i in range(5)]
    proc = _run_forked(_child_writes, prefix, theirs)
    proc.join(30)
    assert proc.exitcode == 0
    bufs = [torch.zeros(PAGE, dtype=torch.uint8) for _ in keys + theirs]
    assert store.batch_io_v1(IoOp.GET, keys + theirs, bufs) == [True] * 7
    assert [b.numpy().tobytes() for b in bufs] == [pattern(k, PAGE) for k in keys + theirs]
    store.close()
