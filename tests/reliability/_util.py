"""Shared helpers of the reliability suite (importable by tests and by child processes)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HAVE_FILE = importlib.util.find_spec("hicache_file") is not None
HAVE_HF3FS = importlib.util.find_spec("hicache_hf3fs_stub") is not None
HAVE_MOONCAKE = importlib.util.find_spec("hicache_mooncake") is not None

# Page geometry used by the file/hf3fs tests: MHA KV, 2 components of 16 KiB each.
GEOMETRY = {"page_size": 16, "num_layers": 4, "num_heads": 2, "head_dim": 64}


def backend_listed(name: str) -> bool:
    """Whether ``hicache backends`` lists ``name`` with status ``ok`` (no import of other backends)."""
    from hicache_core.plugin.registry import availability, find_backends, load_backend_class

    name = backend_name(name)
    if name not in find_backends():
        return False
    try:
        return availability(load_backend_class(name)) is None
    except Exception:
        return False


def local_store_backends() -> list[Any]:
    """``pytest.param`` for each on-disk backend (file in both layouts, hf3fs), skipped when not
    installed. ``"file-segments"`` is the file backend with ``layout: "segments"``."""
    import pytest

    return [
        pytest.param("file", marks=pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed")),
        pytest.param(
            "file-segments", marks=pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed")
        ),
        pytest.param(
            "hf3fs", marks=pytest.mark.skipif(not HAVE_HF3FS, reason="hicache-hf3fs-stub not installed")
        ),
    ]


def backend_name(backend: str) -> str:
    """The entry-point name of a parametrized backend (``"file-segments"`` is ``"file"``)."""
    return "file" if backend == "file-segments" else backend


def store_options(backend: str, root: Path) -> dict[str, Any]:
    """Options putting every byte of ``backend`` under ``root``."""
    if backend == "file":
        return {"root": str(root), "io_threads": 2}
    if backend == "file-segments":
        return {"root": str(root), "io_threads": 2, "layout": "segments"}
    if backend == "hf3fs":
        return {
            "file_path_prefix": str(root / "hf3fs"),
            "file_size": 2 << 30,
        }  # sparse: no eviction in a test
    raise ValueError(backend)


def hex_hash(ns: str, i: int) -> str:
    """A valid page hash (64 hex digits) for page ``i`` of namespace ``ns``."""
    return hashlib.sha256(f"{ns}:{i}".encode()).hexdigest()


def page_bytes(page_hash: str, component: int, nbytes: int) -> bytes:
    """The deterministic content of one page component (writers and verifiers agree)."""
    return hashlib.shake_128(f"{page_hash}/{component}".encode()).digest(nbytes)


def fill_pages(pool: Any, slots: Iterable[int], hashes: Iterable[str]) -> None:
    """Write the deterministic content of ``hashes`` into host ``slots`` of ``pool``."""
    import torch

    sizes = pool.component_nbytes
    for slot, h in zip(slots, hashes):
        for c, view in enumerate(pool.page_views([slot])[0]):
            view.copy_(
                torch.frombuffer(bytearray(page_bytes(h, c, sizes[c])), dtype=torch.uint8).view(view.shape)
            )


def page_matches(pool: Any, slot: int, page_hash: str) -> bool:
    sizes = pool.component_nbytes
    views = pool.page_views([slot])[0]
    return all(
        bytes(v.contiguous().numpy().tobytes()) == page_bytes(page_hash, c, sizes[c])
        for c, v in enumerate(views)
    )


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """``relative path -> (size, mtime_ns)`` of every file under ``path`` (for write-outside checks)."""
    out: dict[str, tuple[int, int]] = {}
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            out[os.path.relpath(p, path)] = (st.st_size, st.st_mtime_ns)
    return out


def temp_files(root: Path) -> list[str]:
    """Leftover temp files of the file backend (``.tmp-*``) or of hf3fs (``*.tmp.<pid>``)."""
    return [
        p for p in tree(root) if os.path.basename(p).startswith(".tmp-") or ".tmp." in os.path.basename(p)
    ]


def report(record_property: Any, name: str, **counts: Any) -> None:
    """Print the counts (visible with ``-s``) and record them as junit properties."""
    text = ", ".join(f"{k}={v}" for k, v in counts.items())
    print(f"\n[reliability:{name}] {text}")
    for k, v in counts.items():
        record_property(f"{name}.{k}", v)
