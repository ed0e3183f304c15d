"""Helpers shared by the hf3fs tests (imported by module name; pytest puts this directory on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from hicache_core import HostPool, StorageConfig

REPO = Path(__file__).resolve().parents[2]


def config(prefix: Path | str, *, options: dict[str, Any] | None = None, **fields: Any) -> StorageConfig:
    """An hf3fs StorageConfig with files under ``prefix`` (64 slots unless overridden)."""
    opts: dict[str, Any] = {"file_path_prefix": str(prefix), "num_slots": 64}
    opts.update(options or {})
    return StorageConfig(backend="hf3fs", options=opts, **fields)


def fill(pool: HostPool, seed: int) -> None:
    """Deterministic pseudo-random bytes in every buffer (same bytes in every process)."""
    for i, buf in enumerate(pool.buffers()):
        g = torch.Generator().manual_seed(seed * 1009 + i)
        buf.copy_(torch.randint(0, 256, tuple(buf.shape), dtype=torch.uint8, generator=g))


def page_bytes(pool: HostPool, index: int) -> list[bytes]:
    """The bytes of one host page, one entry per component."""
    return [v.contiguous().numpy().tobytes() for v in pool.page_views([index])[0]]


def pattern(key: str, nbytes: int) -> bytes:
    """Bytes that depend on ``key`` everywhere (so any mix of two pages is detectable)."""
    import hashlib

    seed = hashlib.sha256(key.encode()).digest()
    reps = nbytes // len(seed) + 1
    return (seed * reps)[:nbytes]


def run_python(code: str, *args: str, timeout: float = 60.0) -> dict[str, Any]:
    """Run ``code`` in a FRESH interpreter; it must print one JSON object as its last line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


_cli_backends: subprocess.Popen[str] | None = None


def _cli_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}


def start_cli_backends() -> None:
    """Start ``hicache backends --json`` early (it imports every backend: seconds of I/O wait)."""
    global _cli_backends
    if _cli_backends is None:
        _cli_backends = subprocess.Popen(
            [str(Path(sys.executable).with_name("hicache")), "backends", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=_cli_env(),
        )


def cli_backends_result(timeout: float = 120.0) -> tuple[int, str, str]:
    """``(returncode, stdout, stderr)`` of the run started by :func:`start_cli_backends`."""
    start_cli_backends()
    assert _cli_backends is not None
    out, err = _cli_backends.communicate(timeout=timeout)
    return _cli_backends.returncode, out, err
