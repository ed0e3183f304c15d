"""The ``hicache bench`` flow: build, fill, back up, measure the raw baseline, verify, report.

1. Build the profile's pools *planned*, so the controller takes their memory from the store, and
   attach them (draft offload follows the backend's declared capability).
2. Fill every pool with seeded random bytes; hash random token sequences into page-hash chains.
3. For each of ``rounds`` rounds: write the raw baseline (file I/O on the backend's filesystem
   when the backend has a path option, next to it; else memcpy), then back every request up
   through the controller (async, ``io_threads`` in flight) under fresh keys. Interleaving the
   two and keeping the best of each makes the ratio robust to a noisy, shared machine.
4. Without a path option (memcpy baseline), time the baseline's reads here too.
5. Verify in a FRESH process (``python -m hicache_core.bench.verify``): reopen, query,
   prefetch into zeroed pools ``rounds`` times, each after a timed raw read of the baseline files
   into the same views, and compare every byte with the seeded stream. Persistent backends
   are closed first; shared (not persistent) ones stay open meanwhile; backends that are
   neither are verified in-process through a second controller on the same store.
6. Clean up whatever the bench created, whatever the options are called: the verifier clears
   the bench's own (fresh) namespace through ``hicache_clear``; every path option the user did
   not set (:func:`~hicache_core.plugin.registry.path_options`: ``Path``-typed or marked fields)
   was given a fresh directory under one temporary directory, removed at the end with the raw
   baseline's files.

The config comes from :class:`BenchRequest`: ``config`` (a ``StorageConfig`` loaded by the CLI
from ``--config`` / ``$HICACHE_CONFIG`` and ``HICACHE_*``) supplies the extensions and controller
settings; ``backend`` / ``options`` the backend; the profile the model identity.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from ..config import StorageConfig
from ..errors import HiCacheError, OperationNotSupportedError
from ..plugin import find_extensions, load_backend_class
from ..plugin.registry import path_options, with_fresh_paths
from ..transfer import CacheController, DraftOffloadDisabledWarning, TransferResult
from ..types import HitPolicy
from .baseline import Memcpy, RawFiles, component_views
from .data import fill_pools, request_hashes
from .profiles import PROFILES, ModelProfile, build_pools, config_fields, requests
from .transfers import progress_bar, run_phase
from .verify import VerifySpec, extension_snapshot, stored_bytes, stored_pools, verify

__all__ = ["BenchRequest", "render", "run_bench"]

VERIFY_TIMEOUT_S = 900.0
METRICS_MISSING = (
    "metrics: the 'metrics' extension is not installed (no entry point named 'metrics' in group "
    "'hicache.extensions'); install a distribution that provides it to get a snapshot"
)


@dataclass(frozen=True)
class BenchRequest:
    """The parsed ``hicache bench`` arguments."""

    backend: str = "file"
    options: dict[str, Any] | None = None
    model: str = "llama3-8b"
    draft: bool = False
    pages: int = 256
    metrics: bool = False
    seed: int | None = None
    rounds: int = 2
    progress: bool = True
    config_source: str = "defaults"
    """Where ``config`` came from, for the report (a file path, ``HICACHE_*``, or defaults)."""
    config: StorageConfig | None = None
    """Everything but the backend, its options and the model identity (controller settings,
    extensions, ...): the ``StorageConfig`` of ``--config`` / ``$HICACHE_CONFIG`` / ``HICACHE_*``."""


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _ratio(baseline_s: float, hicache_s: float) -> float:
    """hicache throughput / baseline throughput on the same bytes (= baseline time / hicache time)."""
    return baseline_s / hicache_s if hicache_s > 0 else 0.0


def _raw_dir(root: str, stack: ExitStack) -> str:
    """A scratch directory next to ``root`` (same filesystem), removed on exit."""
    root = os.path.abspath(root)
    for parent in (os.path.dirname(root), root, None):
        try:
            path = tempfile.mkdtemp(prefix="hicache-bench-raw-", dir=parent)
        except OSError:
            continue
        stack.callback(shutil.rmtree, path, True)
        return path
    raise OSError(f"hicache bench: cannot create a scratch directory for the raw baseline near {root}")


def _storage_path(ctl: CacheController) -> str | None:
    """The first path option of the opened store (where the backend keeps its files), if any."""
    for name in path_options(type(ctl.store.options)):
        value = getattr(ctl.store.options, name, None)
        if isinstance(value, (str, os.PathLike)) and os.fspath(value):
            return os.fspath(value)
    return None


def _baseline(ctl: CacheController, views: list[Any], stack: ExitStack) -> RawFiles | Memcpy:
    root = _storage_path(ctl)
    if root is not None:
        fsync = bool(getattr(ctl.store.options, "fsync", False))
        # As many threads as hicache may use: the controller's, or the backend's own per batch.
        threads = max(ctl.settings.io_threads, int(getattr(ctl.store.options, "io_threads", 1) or 1))
        raw = RawFiles(_raw_dir(root, stack), views, threads, fsync)
        stack.callback(raw.remove)
        return raw
    return Memcpy(views)


def _bench_config(
    req: BenchRequest, profile: ModelProfile, options: dict[str, Any], metrics: bool
) -> StorageConfig:
    """The bench's config: ``req.config``'s settings, the backend and options, the profile's model
    identity under a fresh model name (so a fresh key namespace, cleared at the end)."""
    base = req.config.model_dump(exclude={"controller"}) if req.config is not None else {}
    extensions = list(base.pop("extensions", []))
    if metrics and "metrics" not in extensions:
        extensions.append("metrics")
    fields = {
        **base,
        "backend": req.backend,
        "options": options,
        "model_name": f"hicache-bench-{profile.name}-{secrets.token_hex(4)}",
        "extensions": extensions,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        **config_fields(profile),
    }
    if req.config is not None:
        fields["controller"] = req.config.controller
    return StorageConfig(**fields)


def _cleanup(checked: dict[str, Any], created: list[str], all_temp: bool, namespace: str) -> dict[str, Any]:
    """What the bench removed and whether anything of it may remain (``checked``: the verifier's
    result; ``created``: the temporary paths; ``all_temp``: every path option was one of them)."""
    cleared = checked.get("cleared")
    why = checked.get("clear_error") or "the backend does not implement hicache_clear"
    if isinstance(cleared, int):
        note, left = f"cleared the bench's namespace ({cleared} objects)", False
    elif all_temp:
        note, left = f"did not clear the bench's namespace ({why}), but all its storage was temporary", False
    else:
        note, left = f"could NOT clear the bench's namespace {namespace!r}: {why}", True
    if created:
        note += f"; removed the temporary path(s) {', '.join(created)}"
    return {
        "namespace": namespace,
        "cleared": cleared,
        "temp_paths": created,
        "left_behind": left,
        "note": note,
    }


def _clear_fallback(ctl: CacheController, config: StorageConfig, cleared: dict[str, Any]) -> None:
    """Clear the bench's namespace when the verifier did not (it failed, or the bench stopped
    early); records the outcome in ``cleared``. Never raises: it runs while unwinding."""
    if "cleared" in cleared or "clear_error" in cleared:
        return
    from ..plugin import open_store

    try:
        if not ctl.store.closed:
            cleared["cleared"] = ctl.store.clear()
        else:
            with open_store(config) as store:
                cleared["cleared"] = store.clear()
    except OperationNotSupportedError:
        cleared["cleared"] = None
    except HiCacheError as err:
        cleared["clear_error"] = f"{type(err).__name__}: {err}"


def _child_verify(spec: VerifySpec) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "hicache_core.bench.verify"]
    try:
        proc = subprocess.run(
            cmd, input=spec.to_json(), stdout=subprocess.PIPE, text=True, timeout=VERIFY_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"verified": False, "error": f"verifier timed out after {VERIFY_TIMEOUT_S:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = "\n".join(lines[-5:]) or "(no output)"
        return {"verified": False, "error": f"verifier exited with code {proc.returncode}: {tail}"}
    result["verify_process"] = "fresh process (python -m hicache_core.bench.verify)"
    return result


def _backup_problems(round_: int, reqs_pages: list[int], results: list[Any], draft: bool) -> list[str]:
    problems: list[str] = []
    for i, (pages, res) in enumerate(zip(reqs_pages, results)):
        assert isinstance(res, TransferResult)
        where = f"round {round_}, request {i}"
        if res.pages != pages or not res.ok:
            per_pool = ", ".join(f"{p.value} {sum(f)}/{len(f)}" for p, f in res.per_pool.items())
            problems.append(f"{where}: backup stored {res.pages} of {pages} pages ({per_pool})")
        if res.skipped:
            problems.append(f"{where}: {res.skipped} pages already existed (not written)")
        if draft and not all(res.draft or [False]):
            problems.append(f"{where}: draft pages were not all stored")
        problems.extend(res.errors)
    return problems


def run_bench(req: BenchRequest) -> dict[str, Any]:
    """Run the whole bench; return the report (``report["verified"]`` decides the exit code)."""
    t_start = time.perf_counter()
    backend_cls = load_backend_class(req.backend)  # unknown name -> BackendNotFoundError, first
    profile: ModelProfile = PROFILES[req.model]
    seed = req.seed if req.seed is not None else secrets.randbits(31)
    metrics_installed = req.metrics and "metrics" in find_extensions()
    with ExitStack() as stack:
        # Every path option the user left unset gets a fresh path in one temporary directory,
        # removed at the end whatever the options are called (the bench leaves nothing behind).
        wanted = path_options(backend_cls.Options)  # type: ignore[attr-defined]
        options = dict(req.options or {})
        created: list[str] = []
        if any(options.get(name) is None for name in wanted):
            workdir = tempfile.mkdtemp(prefix="hicache-bench-")
            stack.callback(shutil.rmtree, workdir, True)
            options = with_fresh_paths(backend_cls.Options, options, workdir)  # type: ignore[attr-defined]
            created = [options[n] for n in wanted if (req.options or {}).get(n) is None]
        config = _bench_config(req, profile, options, metrics_installed)
        group = build_pools(profile, req.pages, req.draft)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DraftOffloadDisabledWarning)
            ctl = CacheController(config, group)
        stack.callback(ctl.close)
        cleared: dict[str, Any] = {}  # the verifier's clear, else the fallback's below
        stack.callback(_clear_fallback, ctl, config, cleared)  # runs first: before ctl.close
        caps = ctl.store.capabilities
        reqs = requests(req.pages)
        pools = stored_pools(group, ctl.draft_enabled)
        nbytes = stored_bytes(group, pools)
        base = _baseline(ctl, component_views(group, pools), stack)
        fill_pools(group, seed)
        backup_runs: list[float] = []
        write_runs: list[float] = []
        problems: list[str] = []
        with progress_bar(req.progress) as bar:
            bar.start("backup", req.pages * req.rounds)
            for k in range(req.rounds):  # each round writes fresh keys; raw and hicache interleaved
                hashes = request_hashes(seed, reqs, profile.page_tokens, round=k)
                write_runs.append(base.write())
                seconds, backed = run_phase(ctl, "backup", profile, reqs, hashes, bar)
                backup_runs.append(seconds)
                problems += _backup_problems(k, [r.pages for r in reqs], backed, ctl.draft_enabled)
        read_runs = [base.read() for _ in range(req.rounds)] if isinstance(base, Memcpy) else []
        backup_metrics = extension_snapshot(ctl.store, "metrics") if metrics_installed else None
        spec = VerifySpec(
            config.model_dump(mode="json"),
            profile.name,
            req.pages,
            req.draft,
            seed,
            rounds=req.rounds,
            progress=req.progress,
            clear=True,  # the bench's own namespace, wherever the backend keeps it
            raw_dir=base.directory if isinstance(base, RawFiles) else None,
            raw_threads=base.threads if isinstance(base, RawFiles) else 1,
        )
        if caps.persistent:
            ctl.close()
            checked = _child_verify(spec)
        elif caps.shared:
            checked = _child_verify(spec)
        else:
            checked = verify(spec, store=ctl.store, group=group)
            checked["verify_process"] = "same process (the backend is neither persistent nor shared)"
        cleared.update((k, checked[k]) for k in ("cleared", "clear_error") if k in checked)
    namespace = ctl.store.keys.scheme.namespace
    cleanup = _cleanup(cleared, created, bool(wanted) and len(created) == len(wanted), namespace)
    problems.extend(checked.get("problems", []))
    if "error" in checked:
        problems.append(str(checked["error"]))
    read_runs = read_runs or list(checked.get("raw_read_runs", []))
    prefetch_runs = list(checked.get("prefetch_runs", []))
    backup_s, write_s = min(backup_runs), min(write_runs)
    prefetch_s = min(prefetch_runs, default=0.0)
    read_s = min(read_runs, default=0.0)
    report: dict[str, Any] = {
        "backend": req.backend,
        "model": profile.name,
        "model_shape": profile.describe(),
        "pages": req.pages,
        "requests": len(reqs),
        "page_bytes": sum(group[n].page_nbytes for n in pools if group[n].hit_policy is HitPolicy.ALL_PAGES),
        "bytes": nbytes,
        "rounds": req.rounds,
        "io_path": ctl.io_path,
        "io_threads": ctl.settings.io_threads,
        "verified": bool(checked.get("verified")) and not problems,
        "verified_bytes": int(checked.get("verified_bytes", 0)),
        "verify_process": checked.get("verify_process", "-"),
        "backup_s": backup_s,
        "backup_gbps": _gbps(nbytes, backup_s),
        "prefetch_s": prefetch_s,
        "prefetch_gbps": _gbps(nbytes, prefetch_s),
        "query_s": float(checked.get("query_s", 0.0)),
        "baseline": base.name,
        "baseline_write_gbps": _gbps(nbytes, write_s),
        "baseline_read_gbps": _gbps(nbytes, read_s),
        "backup_ratio": _ratio(write_s, backup_s),
        "prefetch_ratio": _ratio(read_s, prefetch_s),
        "runs_s": {
            "backup": backup_runs,
            "baseline_write": write_runs,
            "prefetch": prefetch_runs,
            "baseline_read": read_runs,
        },
        "draft": {
            "requested": req.draft,
            "enabled": ctl.draft_enabled,
            "mode": ctl.draft_io.mode.value if req.draft else None,
            "reason": ctl.draft_io.reason if req.draft else "not requested (pass --draft)",
        },
        "seed": seed,
        "config": req.config_source,
        "cleanup": cleanup,
        "problems": problems[:20],
        "elapsed_s": time.perf_counter() - t_start,
    }
    if req.metrics:
        report["metrics"] = (
            {"installed": True, "backup": backup_metrics, "prefetch": checked.get("metrics")}
            if metrics_installed
            else {"installed": False, "message": METRICS_MISSING}
        )
    return report


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def render(report: dict[str, Any]) -> None:
    """Print the human-readable report (rich) on stdout."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    draft = report["draft"]
    if draft["enabled"]:
        draft_s = f"enabled ({draft['mode']})"
    elif draft["requested"]:
        draft_s = f"disabled: {draft['reason']}"
    else:
        draft_s = "off (pass --draft)"
    console.print(
        f"[bold]hicache bench[/bold]: backend [cyan]{report['backend']}[/cyan], model "
        f"[cyan]{report['model']}[/cyan] ({report['model_shape']})\n"
        f"{report['pages']} pages in {report['requests']} request(s), {_size(report['page_bytes'])}/page, "
        f"{_size(report['bytes'])} stored; I/O path {report['io_path']}, {report['io_threads']} I/O "
        f"thread(s); draft {draft_s}"
    )
    table = Table(title=None)
    for col in ("phase", "seconds", "GB/s", "baseline GB/s", "ratio"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    table.add_row(
        "backup",
        f"{report['backup_s']:.3f}",
        f"{report['backup_gbps']:.2f}",
        f"{report['baseline_write_gbps']:.2f}",
        f"{report['backup_ratio']:.2f}",
    )
    table.add_row(
        "prefetch",
        f"{report['prefetch_s']:.3f}",
        f"{report['prefetch_gbps']:.2f}",
        f"{report['baseline_read_gbps']:.2f}",
        f"{report['prefetch_ratio']:.2f}",
    )
    table.add_row("query", f"{report['query_s']:.3f}", "-", "-", "-")
    console.print(table)
    console.print(f"baseline: {report['baseline']}")
    if report["verified"]:
        console.print(
            f"[green]verified[/green] {report['verified_bytes']:,} bytes, every byte, in a "
            f"{report['verify_process']}; total {report['elapsed_s']:.1f} s"
        )
    else:
        console.print("[red]NOT verified[/red]:")
        for p in report["problems"] or ["(no detail)"]:
            console.print(f"  - {p}", markup=False)
    cleanup = report.get("cleanup") or {}
    if cleanup.get("note"):
        style = "yellow" if cleanup.get("left_behind") else "dim"
        console.print(f"[{style}]clean-up: {escape(cleanup['note'])}[/{style}]")
    metrics = report.get("metrics")
    if metrics is not None:
        if metrics["installed"]:
            console.print_json(json.dumps({"backup": metrics["backup"], "prefetch": metrics["prefetch"]}))
        else:
            console.print(metrics["message"], markup=False)
