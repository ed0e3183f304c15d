"""Private internals of ``hicache bench`` (not a public API; may change without notice).

* :mod:`.profiles`: model profiles (per-rank pool shapes of real models) and the workload
  layout (requests, host indices, Mamba slots);
* :mod:`.data`: deterministic random page contents, page hashes and byte-exact verification;
* :mod:`.baseline`: the raw baselines measured in the same run (file I/O or memcpy);
* :mod:`.transfers`: running controller operations concurrently with a progress bar;
* :mod:`.verify`: the fresh-process verifier (``python -m hicache_core.bench.verify``);
* :mod:`.runner`: the ``hicache bench`` flow and its report.

Nothing here is imported by ``import hicache_core``.
"""

from .runner import BenchRequest, render, run_bench

__all__ = ["BenchRequest", "render", "run_bench"]
