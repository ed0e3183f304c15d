"""The verifier of ``hicache bench``: reopen the store, query, prefetch into zeroed pools, compare.

Run as ``python -m hicache_core.bench.verify`` (a fresh process: nothing of the writer's
memory, backend instance or caches survives), with a JSON :class:`VerifySpec` on stdin. It prints
one JSON object on stdout: timings, per-request prefix lengths, bytes checked, mismatches and
errors. :func:`verify` is also called in-process for backends that are neither persistent nor
shared (their data cannot outlive the writer's process).
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ..config import StorageConfig
from ..errors import HiCacheError, OperationNotSupportedError
from ..plugin import Store
from ..pools import HostPoolGroup
from ..transfer import CacheController, DraftOffloadDisabledWarning, QueryResult, TransferResult
from ..types import PoolName
from .baseline import RawFiles, component_views
from .data import request_hashes, verify_pools
from .profiles import PROFILES, build_pools, requests
from .transfers import progress_bar, run_phase

__all__ = ["VerifySpec", "extension_snapshot", "main", "stored_bytes", "stored_pools", "verify"]


@dataclass(frozen=True)
class VerifySpec:
    """Everything the verifier needs; JSON-serialisable.

    ``rounds``: prefetches to time (the backup wrote ``rounds`` key sets; the last one is read).
    ``raw_dir``: where the writer left the raw-baseline files, read back between prefetches.
    """

    config: dict[str, Any]
    profile: str
    pages: int
    draft: bool
    seed: int
    rounds: int = 1
    progress: bool = False
    clear: bool = False
    raw_dir: str | None = None
    raw_threads: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> VerifySpec:
        return cls(**json.loads(text))


def stored_pools(group: HostPoolGroup, draft_enabled: bool) -> list[PoolName]:
    """The pools whose pages go to storage (the draft pool only when draft offload is on)."""
    return [n for n in group if n is not PoolName.DRAFT or draft_enabled]


def stored_bytes(group: HostPoolGroup, pools: Iterable[PoolName]) -> int:
    """Bytes of every page (slot) of ``pools``."""
    return sum(group[n].num_pages * group[n].page_nbytes for n in pools)


def extension_snapshot(store: Store, name: str) -> Any:
    """``snapshot()`` of an enabled extension (``None`` if absent), made JSON-safe."""
    ext = store.extensions.get(name)
    snap = getattr(ext, "snapshot", None)
    if not callable(snap):
        return None if ext is None else repr(ext)
    return json.loads(json.dumps(snap(), default=str))


def _zero(group: HostPoolGroup) -> None:
    """Zero every pool. Just zeroed memory is slower to read into (its dirty cache lines are
    written back meanwhile), so both timed readers start from it, not only the prefetch."""
    for pool in group.values():
        for buf in pool.buffers():
            buf.zero_()


def verify(
    spec: VerifySpec, store: Store | None = None, group: HostPoolGroup | None = None
) -> dict[str, Any]:
    """Reopen (or reuse ``store``), query and prefetch every request, then compare every byte.

    Reusing a store that an open controller shares needs that controller's pools (``group``): a
    shared store serves one pool group. They are zeroed before every prefetch."""
    config = StorageConfig.model_validate(spec.config)
    profile = PROFILES[spec.profile]
    reqs = requests(spec.pages)
    hashes = request_hashes(spec.seed, reqs, profile.page_tokens, round=spec.rounds - 1)
    group = build_pools(profile, spec.pages, spec.draft) if group is None else group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DraftOffloadDisabledWarning)
        ctl = CacheController(config, group, store=store)
    try:
        pools = stored_pools(group, ctl.draft_enabled)
        views = component_views(group, pools)
        raw = RawFiles(spec.raw_dir, views, spec.raw_threads, False) if spec.raw_dir else None
        prefetch_runs: list[float] = []
        raw_read_runs: list[float] = []
        fetched: list[TransferResult | QueryResult] = []
        with progress_bar(spec.progress) as bar:
            bar.start("query (fresh process)", spec.pages)
            query_s, queried = run_phase(ctl, "query", profile, reqs, hashes, bar)
            bar.start("prefetch", spec.pages * spec.rounds)
            for _ in range(spec.rounds):
                if raw is not None:
                    _zero(group)  # the raw reads start from the same state as the prefetch
                    raw_read_runs.append(raw.read())  # interleaved, into the same views
                _zero(group)  # each prefetch lands in zeroed (and pre-faulted) pools
                seconds, fetched = run_phase(ctl, "prefetch", profile, reqs, hashes, bar)
                prefetch_runs.append(seconds)
        report = verify_pools(group, spec.seed, pools)
        problems: list[str] = []
        for r, q, p in zip(reqs, queried, fetched):
            assert isinstance(q, QueryResult) and isinstance(p, TransferResult)
            if q.pages != r.pages:
                problems.append(f"request {r.index}: query found {q.pages} of {r.pages} pages")
            if p.pages != r.pages or not p.ok:
                problems.append(f"request {r.index}: prefetch restored {p.pages} of {r.pages} pages")
            if ctl.draft_enabled and not all(p.draft or [False]):
                problems.append(f"request {r.index}: draft pages were not all restored")
            problems.extend(q.errors + p.errors)
        problems.extend(str(m) for m in report.mismatches)
        result: dict[str, Any] = {
            "verified": report.ok and not problems,
            "verified_bytes": report.bytes_checked if report.ok else 0,
            "bytes_checked": report.bytes_checked,
            "prefetch_bytes": stored_bytes(group, pools),
            "prefetch_runs": prefetch_runs,
            "raw_read_runs": raw_read_runs,
            "query_s": query_s,
            "query_pages": sum(q.pages for q in queried if isinstance(q, QueryResult)),
            "problems": problems[:20],
            "draft_enabled": ctl.draft_enabled,
            "metrics": extension_snapshot(ctl.store, "metrics") if "metrics" in config.extensions else None,
        }
        if spec.clear:
            try:
                result["cleared"] = ctl.clear()
            except OperationNotSupportedError:
                result["cleared"] = None
            except HiCacheError as err:  # e.g. a hicache_clear that returns None
                result["clear_error"] = f"{type(err).__name__}: {err}"
        return result
    finally:
        ctl.close()


def main() -> int:
    """Entry point of ``python -m hicache_core.bench.verify``: spec on stdin, result on stdout."""
    spec = VerifySpec.from_json(sys.stdin.read())
    try:
        result = verify(spec)
    except HiCacheError as err:
        result = {"verified": False, "error": f"{type(err).__name__}: {err}"}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
