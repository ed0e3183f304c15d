"""Helpers of the conformance tests (importable as ``tests.conformance.helpers``)."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
MODULE = "hicache_broken_backends"


def write_dist(site: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    """Write modules and a ``*.dist-info`` declaring ``hicache.backends`` entry points into ``site``.

    Unlike ``tests.support.distinfo.installed_dist`` this does not touch ``sys.path``: the site is
    meant for subprocesses (``PYTHONPATH``), so other tests of this session never see it.
    """
    site.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (site / f"{name}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    lines = ["[hicache.backends]", *(f"{n} = {v}" for n, v in entry_points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site


def subprocess_env(*paths: Path) -> dict[str, str]:
    """The environment of a test subprocess: ``paths`` and the repository on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), str(REPO)])
    for var in ("PYTEST_ADDOPTS", "HICACHE_BACKENDS_ALLOW", "HICACHE_BACKENDS_BLOCK"):
        env.pop(var, None)
    return env
