"""Helpers of the draft-capability matrix (also imported by the fresh-process verifier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_core import (
    HostPoolGroup,
    MHAKVPool,
    MLAKVPool,
    PoolName,
    StorageConfig,
    backend_names,
    page_hashes,
)

try:
    import hicache_mooncake.testing  # noqa: F401  (its fixtures are imported by conftest.py)
except ImportError as err:  # pragma: no cover - depends on the installed plugins
    MOONCAKE_MISSING: str | None = f"hicache-mooncake is not importable: {err}"
else:
    MOONCAKE_MISSING = None

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
N = 6  # pages per request
PAGES = 8  # host pages per pool
VARIANTS = [("mha", False), ("mha", True), ("mla", False), ("mla", True)]


def make_group(variant: str, *, allocate: bool = False) -> HostPoolGroup:
    """Target KV plus a draft pool of the same attention kind (one draft layer)."""
    if variant == "mha":
        kv: Any = MHAKVPool(PAGES, 4, 2, 2, 8, torch.bfloat16, allocate=allocate)
        draft: Any = MHAKVPool(PAGES, 4, 1, 2, 8, torch.bfloat16, allocate=allocate)
    else:
        kv = MLAKVPool(PAGES, 4, 2, 24, torch.bfloat16, allocate=allocate)
        draft = MLAKVPool(PAGES, 4, 1, 24, torch.bfloat16, allocate=allocate)
    return HostPoolGroup(kv, {PoolName.DRAFT: draft})


def fill(group: HostPoolGroup, seed: int) -> None:
    """Deterministic bytes in every buffer (identical in every process for the same shapes)."""
    for p, name in enumerate(sorted(group, key=lambda n: n.value)):
        for i, buf in enumerate(group[name].buffers()):
            g = torch.Generator().manual_seed(seed * 7919 + p * 101 + i)
            buf.copy_(torch.randint(0, 256, tuple(buf.shape), dtype=torch.uint8, generator=g))


def page_bytes(group: HostPoolGroup, name: PoolName, index: int) -> list[bytes]:
    return [v.contiguous().numpy().tobytes() for v in group[name].page_views([index])[0]]


def same_pages(a: HostPoolGroup, b: HostPoolGroup, name: PoolName, n: int = N) -> bool:
    return all(page_bytes(a, name, i) == page_bytes(b, name, i) for i in range(n))


def make_config(backend: str, options: dict[str, Any], variant: str, split: bool) -> StorageConfig:
    return StorageConfig(
        backend=backend,
        options=options,
        model_name=f"draft-matrix-{backend}-{variant}-{int(split)}-{os.getpid()}",
        is_mla_model=variant == "mla",
        should_split_heads=split,
    )


def hashes_for(variant: str, split: bool) -> list[str]:
    base = 1000 * (1 + VARIANTS.index((variant, split)))
    return page_hashes(list(range(base, base + 4 * N)), 4)


VERIFY = r"""
import json, os, sys, warnings
from draft_util import N, make_group, fill, same_pages
from hicache_core import CacheController, PoolName, StorageConfig

spec = json.loads(sys.argv[1])
out = {}
opened = []
for cid, case in spec.items():
    try:
        cfg = StorageConfig.model_validate(case["config"])
        group = make_group(case["variant"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ctl = CacheController(cfg, group)
        opened.append(ctl)
        if True:
            ref = make_group(case["variant"], allocate=True)
            fill(ref, case["seed"])
            r = ctl.prefetch(case["hashes"], list(range(N)))
            out[cid] = {
                "pages": r.pages,
                "draft": r.draft,
                "draft_enabled": ctl.draft_enabled,
                "target_same": same_pages(group, ref, PoolName.KV),
                "draft_same": same_pages(group, ref, PoolName.DRAFT) if ctl.draft_enabled else None,
                "errors": list(r.errors),
            }
    except Exception as err:
        out[cid] = {"error": f"{type(err).__name__}: {err}"}
print(json.dumps(out), flush=True)
# Mooncake readers here mount no memory (global_segment_size=0), so nothing is lost by not
# waiting ~1-2 s per client for the unmount; the other stores close normally.
for ctl in opened:
    if ctl.config.backend != "mooncake":
        ctl.close()
os._exit(0)
"""


def run_verifier(spec: dict[str, Any], timeout: float = 180.0) -> dict[str, Any]:
    """Prefetch every case in ONE fresh interpreter (shares nothing with the writers)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", VERIFY, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"verifier failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def backend_options(backend: str, root: Path, request: Any) -> dict[str, Any]:
    """Options of a real backend for this test run; ``pytest.skip`` when it is not installed."""
    if backend not in backend_names():
        pytest.skip(f"backend {backend!r} is not installed (pip install -e plugins/...)")
    if backend == "file":
        return {"root": str(root / "file")}
    if backend == "hf3fs":
        return {"file_path_prefix": str(root / "hf3fs" / "h"), "num_slots": 256}
    if backend == "nixl":  # NIXL's POSIX plugin: files under a root, zero-copy from the pools
        return {"root": str(root / "nixl")}
    if backend == "mooncake":
        if MOONCAKE_MISSING:
            pytest.skip(MOONCAKE_MISSING)
        try:
            master = request.getfixturevalue("mooncake_master")
        except Exception as err:  # a missing binary or library: say so, never fake the store
            pytest.skip(f"mooncake_master could not start: {type(err).__name__}: {err}")
        return {
            "master_server_address": master.address,
            "local_hostname": "127.0.0.1",
            "global_segment_size": "64MB",
            "local_buffer_size": "16MB",
            "load_env": False,
        }
    raise AssertionError(f"no options recipe for backend {backend!r}")
