"""Shared helpers of the file backend tests (imported as a sibling module)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from hicache_core import HostPool, Layout, StorageConfig


def config(root: str | os.PathLike[str], **kw: Any) -> StorageConfig:
    """A ``file`` backend config rooted at ``root`` (extra options via ``options=``)."""
    options = {"root": str(root), **kw.pop("options", {})}
    return StorageConfig(backend="file", options=options, **kw)


def fill(pool: HostPool, seed: int) -> None:
    """Deterministic random bytes in every component buffer."""
    g = torch.Generator().manual_seed(seed)
    for b in pool.buffers():
        b.copy_(torch.randint(0, 256, tuple(b.shape), dtype=torch.uint8, generator=g))


def pages(pool: HostPool, slots: Sequence[int]) -> list[bytes]:
    """The bytes of each (slot, component), in layer-major order (layout independent)."""
    out = []
    for views in pool.page_views(list(slots)):
        for v in views:
            out.append(v.contiguous().numpy().tobytes())
    return out


def zero(pool: HostPool) -> None:
    for b in pool.buffers():
        b.zero_()


def page_slice(pool: HostPool, n: int) -> list[torch.Tensor]:
    """The first ``n`` pages of every component buffer."""
    if pool.layout is Layout.PAGE_FIRST:
        return [b[:n] for b in pool.buffers()]
    return [b[:, :n] for b in pool.buffers()]


def files_under(root: str | os.PathLike[str]) -> list[str]:
    """Every regular file below ``root`` (relative paths), excluding the format marker."""
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel != ".hicache-file.json":
                out.append(rel)
    return sorted(out)


def temp_files(root: str | os.PathLike[str]) -> list[str]:
    return [f for f in files_under(root) if os.path.basename(f).startswith(".tmp-")]


# ----------------------------------------------------------------- child processes
def pattern(key: str, nbytes: int) -> bytes:
    """Deterministic page bytes for ``key`` (so any process can verify any page)."""
    import hashlib

    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def crash_writer(root: str, nbytes: int, start: int, ready: Any, publish: str) -> None:
    """Child: write 4-key batches of ``pattern`` pages forever (until SIGKILLed)."""
    from hicache_core import IoOp, open_store

    options = {"io_threads": 2, "parallel_min_bytes": 0, "publish": publish}
    store = open_store(config(root, options=options))
    i = start
    ready.set()
    while True:
        keys = [f"crash.p.{j:06d}" for j in range(i, i + 4)]
        bufs = [torch.frombuffer(bytearray(pattern(k, nbytes)), dtype=torch.uint8) for k in keys]
        store.batch_io_v1(IoOp.SET, keys, bufs)
        i += 4


def shared_writer(root: str, rounds: int) -> None:
    """Child: write the same 200 pages ``rounds`` times (racing another writer)."""
    from hicache_core import IoOp, open_store

    with open_store(config(root)) as store:
        keys = [f"shared.p.{j:04d}" for j in range(200)]
        bufs = [torch.full((4096,), j % 251, dtype=torch.uint8) for j in range(200)]
        for _ in range(rounds):
            if not all(store.batch_io_v1(IoOp.SET, keys, bufs)):
                raise SystemExit(3)


def budget_writer(root: str, options: dict[str, Any], writer: int, batches: int, bar: Any, q: Any) -> None:
    """Child: open a store on ``root``, wait for the others, write ``batches`` batches of 16
    ``pattern`` pages of 16 KiB, then keep the store open until the parent has measured."""
    from hicache_core import IoOp, open_store

    with open_store(config(root, options=options)) as store:
        bar.wait()
        for b in range(batches):
            keys = [f"bud.w{writer}-{b:04d}-{j:02d}" for j in range(16)]
            bufs = [torch.frombuffer(bytearray(pattern(k, 16 << 10)), dtype=torch.uint8) for k in keys]
            if not all(store.batch_io_v1(IoOp.SET, keys, bufs)):
                raise SystemExit(3)
        q.put(writer)
        bar.wait()  # the parent measures the root now
        bar.wait()
