"""Create throwaway plugin distributions (real ``*.dist-info`` + modules) on ``sys.path``."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def installed_dist(
    root: Path,
    dist: str,
    entry_points: Mapping[str, Mapping[str, str]],
    modules: Mapping[str, str],
    version: str = "0.0.1",
) -> Iterator[Path]:
    """Write ``modules`` (name -> source) and a dist-info declaring ``entry_points``, put ``root``
    on ``sys.path`` for the duration, then remove it and forget the modules."""
    root.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines.extend(f"{n} = {v}" for n, v in eps.items())
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for name in modules:
            sys.modules.pop(name, None)
        from hicache_core.plugin import registry as _registry

        _registry.clear_caches()
        importlib.invalidate_caches()
