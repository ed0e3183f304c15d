"""The draft-capability matrix over REAL backends (design §5, issue 5).

For each backend: a target KV pool plus a draft pool (MHA target + MHA draft, MLA target + MLA
draft), ``should_split_heads`` False and True. What the controller does comes only from the
declared capability:

* file     -> ``generic``: draft pages go through v1 under their own keys;
* mooncake -> ``zero_copy_v2``: draft goes through v2; split heads disables it with ONE warning
  naming ``should_split_heads``;
* hf3fs    -> ``unsupported``: ONE warning naming the backend and its reason; target KV still works;
* nixl     -> ``zero_copy_v2`` (POSIX plugin): draft goes through v2; split heads turns it to
  ``generic`` (draft pages copied over v1 under their own keys), with no warning.

Every case is backed up here and prefetched by ONE fresh interpreter (``run_verifier``); draft
bytes must equal what was written wherever draft is enabled. The writers stay open until the
verifier is done (Mooncake's embedded data lives in the writer's segment).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from draft_util import (
    VARIANTS,
    N,
    backend_options,
    fill,
    hashes_for,
    make_config,
    make_group,
    page_hashes,
    run_verifier,
    same_pages,
)
from hicache_hf3fs_stub.hf3fs import DRAFT_REASON

from hicache_core import (
    CacheController,
    DraftIoMode,
    DraftOffloadDisabledWarning,
    IoOp,
    PoolName,
    PoolTransfer,
    TransferResult,
    hookimpl,
)

BACKENDS = ("file", "mooncake", "hf3fs", "nixl")
CASES = [(b, v, s) for b in BACKENDS for v, s in VARIANTS]


def case_id(backend: str, variant: str, split: bool) -> str:
    return f"{backend}-{variant}-{'split' if split else 'nosplit'}"


def expected_path(backend: str, split: bool) -> str | None:
    """The draft path the declared capability must produce (None = disabled)."""
    return {
        "file": "v1",
        "mooncake": None if split else "v2",
        "hf3fs": None,
        "nixl": "v1" if split else "v2",
    }[backend]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def open_controller(cfg: Any, group: Any) -> tuple[CacheController, list[str], list[str]]:
    """Attach; return the controller, the draft warnings raised and the warnings logged."""
    handler = _Records()
    logger = logging.getLogger("hicache")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            ctl = CacheController(cfg, group)
    finally:
        logger.removeHandler(handler)
    raised = [str(w.message) for w in rec if issubclass(w.category, DraftOffloadDisabledWarning)]
    logged = [m for m in handler.messages if "draft" in m]
    return ctl, raised, logged


@pytest.fixture(scope="module")
def matrix(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("draft-matrix")
    facts: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    live: list[CacheController] = []
    try:
        for backend in BACKENDS:
            try:
                backend_options(backend, root, request)
            except pytest.skip.Exception as why:
                skipped[backend] = str(why)
                continue
            for seed, (variant, split) in enumerate(VARIANTS, start=11):
                cid = case_id(backend, variant, split)
                # one directory per case: an hf3fs file keeps the slot size it was created with
                opts = backend_options(backend, root / cid, request)
                cfg = make_config(backend, opts, variant, split)
                group = make_group(variant)
                ctl, raised, logged = open_controller(cfg, group)
                live.append(ctl)
                fill(group, seed)
                hashes = hashes_for(variant, split)
                facts[cid] = {
                    "ctl": ctl,
                    "raised": raised,
                    "logged": logged,
                    "backup": ctl.backup(hashes, range(N)),
                    "hashes": hashes,
                }
                reader = cfg.model_dump(mode="json")
                if backend == "mooncake":  # a pure reader: it contributes no memory to the cluster
                    reader["options"] = {**reader["options"], "global_segment_size": 0}
                spec[cid] = {
                    "config": reader,
                    "variant": variant,
                    "seed": seed,
                    "hashes": hashes,
                }
        results = run_verifier(spec) if spec else {}
        yield {"facts": facts, "results": results, "skipped": skipped, "root": root}
    finally:
        # Mooncake clients take ~2 s each to unmount: close every writer concurrently
        with ThreadPoolExecutor(max(1, len(live))) as pool:
            list(pool.map(CacheController.close, live))


def _case(
    matrix: dict[str, Any], backend: str, variant: str, split: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    if backend in matrix["skipped"]:
        pytest.skip(matrix["skipped"][backend])
    cid = case_id(backend, variant, split)
    return matrix["facts"][cid], matrix["results"][cid]


@pytest.mark.parametrize(("backend", "variant", "split"), CASES, ids=[case_id(*c) for c in CASES])
def test_controller_follows_the_declared_capability(
    matrix: dict[str, Any], backend: str, variant: str, split: bool
) -> None:
    fact, _ = _case(matrix, backend, variant, split)
    ctl: CacheController = fact["ctl"]
    backup: TransferResult = fact["backup"]
    path = expected_path(backend, split)
    assert backup.pages == N and backup.ok and backup.errors == ()  # target KV always works
    assert (ctl.draft_path.io_path if ctl.draft_path else None) == path
    if path is not None:
        assert ctl.draft_enabled and fact["raised"] == [] and fact["logged"] == []
        mode = {"v1": DraftIoMode.GENERIC, "v2": DraftIoMode.ZERO_COPY_V2}[path]
        assert ctl.draft_io.mode is mode
        assert backup.draft == [True] * N
        # draft pages live in their own key space
        draft_keys = {k for page in ctl.store.page_keys(PoolName.DRAFT, fact["hashes"]) for k in page}
        kv_keys = {k for page in ctl.store.page_keys(PoolName.KV, fact["hashes"]) for k in page}
        assert draft_keys.isdisjoint(kv_keys) and all(".draft." in k for k in draft_keys)
        return
    assert not ctl.draft_enabled and backup.draft is None
    assert len(fact["raised"]) == 1 and len(fact["logged"]) == 1, (fact["raised"], fact["logged"])
    msg = fact["raised"][0]
    assert f"backend {backend!r}" in msg
    if backend == "mooncake":
        assert "should_split_heads" in msg
    else:
        assert DRAFT_REASON in msg


@pytest.mark.parametrize(("backend", "variant", "split"), CASES, ids=[case_id(*c) for c in CASES])
def test_fresh_process_prefetch_returns_what_was_written(
    matrix: dict[str, Any], backend: str, variant: str, split: bool
) -> None:
    _, res = _case(matrix, backend, variant, split)
    assert "error" not in res, res
    assert res["pages"] == N and res["target_same"] and res["errors"] == []
    if expected_path(backend, split) is None:
        assert res["draft_enabled"] is False and res["draft"] is None
    else:
        assert res["draft_enabled"] and res["draft"] == [True] * N and res["draft_same"]


class DraftSaboteur:
    """Wraps the I/O hooks in the store's plugin manager and raises for every draft call."""

    def __init__(self) -> None:
        self.target_ops: list[str] = []
        self.draft_failures = 0

    def _check(self, op: IoOp, is_draft: bool) -> None:
        if is_draft:
            self.draft_failures += 1
            raise RuntimeError("injected draft failure")
        self.target_ops.append(IoOp(op).value)

    @hookimpl(wrapper=True)
    def hicache_batch_io_v1(self, op: IoOp, keys: Sequence[str], buffers: Any) -> Any:
        self._check(op, any(k.split(".")[1] == "draft" for k in keys))
        return (yield)

    @hookimpl(wrapper=True)
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> Any:
        self._check(op, any(t.pool is PoolName.DRAFT for t in transfers))
        return (yield)


@pytest.mark.parametrize(
    ("backend", "variant"), [(b, v) for b in ("file", "mooncake") for v in ("mha", "mla")]
)
def test_injected_draft_failure_never_fails_or_delays_target(
    matrix: dict[str, Any], request: pytest.FixtureRequest, backend: str, variant: str
) -> None:
    if backend in matrix["skipped"]:
        pytest.skip(matrix["skipped"][backend])
    opts = backend_options(backend, matrix["root"] / "inject", request)
    group = make_group(variant)
    cfg = make_config(backend, opts, variant, False).model_copy(update={"model_name": f"inject-{variant}"})
    with CacheController(cfg, group) as ctl:
        assert ctl.draft_enabled
        fill(group, 99)
        ref = make_group(variant, allocate=True)
        fill(ref, 99)
        saboteur = DraftSaboteur()
        ctl.store.pm.register(saboteur, name="test:draft-saboteur")
        hashes = page_hashes(list(range(77, 77 + 4 * N)), 4)
        res = ctl.backup(hashes, range(N))
        assert res.pages == N and res.ok and res.errors == () and res.draft == [False] * N
        for buf in (*group[PoolName.KV].buffers(), *group[PoolName.DRAFT].buffers()):
            buf.zero_()
        saboteur.target_ops.clear()
        got = ctl.prefetch(hashes, range(N))
        # the target pages arrive in this very call, read once, with no retry or error
        assert got.pages == N and got.ok and got.errors == () and got.draft == [False] * N
        # every draft call failed: backup's exists (none when the backend declares
        # set_skips_existing) and set, then prefetch's get
        backup_calls = 1 if ctl.store.capabilities.set_skips_existing else 2
        assert saboteur.target_ops.count("get") == 1 and saboteur.draft_failures >= backup_calls + 1
        assert same_pages(group, ref, PoolName.KV)
        assert not any(b.any() for b in group[PoolName.DRAFT].buffers())  # nothing half-loaded
        # without the saboteur the draft pages are written and read again
        ctl.store.pm.unregister(saboteur)
        fill(group, 99)
        assert ctl.backup(hashes, range(N)).draft == [True] * N
        for buf in group[PoolName.DRAFT].buffers():
            buf.zero_()
        assert ctl.prefetch(hashes, range(N)).draft == [True] * N
        assert same_pages(group, ref, PoolName.DRAFT)


def test_every_backend_ran_or_says_why(matrix: dict[str, Any]) -> None:
    assert "hf3fs" not in matrix["skipped"], "hf3fs is part of this distribution and must always run"
    ran = {cid.split("-")[0] for cid in matrix["facts"]}
    assert ran | set(matrix["skipped"]) == set(BACKENDS)
