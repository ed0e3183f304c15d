"""Private internals of ``hicache bench`` (not a public API; may change without notice).

* :mod:`.profiles`: model profiles (per-rank pool shapes of real models) and the workload
  layout (requests, host indices, Mamba slots);
* :mod:`.data`: deterministic random page contents, page hashes and byte-exact verification;
* :mod:`.baseline`: the raw baselines measured in the same run (file I/O or memcpy);
* :mod:`.transfers`: running controller operations concurrently with a progress bar;
* :mod:`.verify`: the fresh-process verifier (``python -m hicache_core.bench.verify``);
* :mod:`.runner`: the ``hicache bench`` flow and its report.

Nothing here is imported by ``import hicache_core``, and importing this package imports none of
its modules until a name is used: ``python -m hicache_core.bench.verify`` then runs a module
that is not already in ``sys.modules`` (runpy would warn about it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BenchRequest", "render", "run_bench"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
