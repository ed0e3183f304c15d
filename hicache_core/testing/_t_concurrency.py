"""Group ``concurrency``: threads moving pages at once, with bytes distinct per writer.

Every writer writes its own seeded bytes for the same page hashes, so a read that mixes two
writes, or that returns bytes no writer wrote, is seen on every run; a page read back must hold,
per component, exactly one writer's bytes. ``test_concurrency_no_torn_pages`` uses big page
components (``torn_component_bytes``, 1 MiB) and keeps readers reading while writers re-set the
same pages until enough reads have overlapped a write, so an in-place (non-atomic) write is
caught every time. The canaries are off here: these tests share pools across threads on purpose.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

import torch

from hicache_core import HostPool, IoOp, MHAKVPool, PoolName, Store

from ._base import SuiteBase
from ._context import SuiteContext, expect_flags
from ._rules import rule

__all__ = ["ConcurrencyTests"]

KV = PoolName.KV
JOIN_TIMEOUT_S = 120
TORN_PAGES = 1  # pages per round of the torn-page test (two components of torn_component_bytes)
TORN_WRITERS = 2
TORN_READERS = 2
TORN_MIN_ROUNDS = 3  # each round races the first write of fresh pages, then re-sets of them
TORN_ROUND_OVERLAPS = 8  # a round's writers keep re-setting until this many reads overlapped them
TORN_MAX_SETS = 64  # ... or until each writer made this many sets
TORN_MIN_OVERLAPS = TORN_MIN_ROUNDS * TORN_ROUND_OVERLAPS
TORN_BUDGET_S = 20.0


def _versions(
    hc: SuiteContext, pool: HostPool, slots: Sequence[int], hashes: Sequence[str], salts: Sequence[int]
) -> list[bool]:
    """Per page: does every component hold exactly one of the writers' versions (``salts``)?"""
    rows = [hc.component_matches(pool, slots, hashes, salt) for salt in salts]
    return [all(any(r[p][c] for r in rows) for c in range(len(rows[0][p]))) for p in range(len(slots))]


def _run(threads: list[threading.Thread]) -> None:
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=JOIN_TIMEOUT_S)
    assert not any(th.is_alive() for th in threads), "a worker thread hung"


class ConcurrencyTests(SuiteBase):
    """Group ``concurrency``."""

    @rule("R36")
    def test_concurrency_backup_prefetch(self, hc: SuiteContext, io_path: str) -> None:
        """R36: Threads back up (each its own bytes) and prefetch overlapping pages; every reported page
        holds one writer's bytes, whole."""
        hc.canary.enabled = False
        n, workers, rounds = 24, 4, 4
        kv = self.make_kv_pool("mha", n * (2 * workers + 1))
        ctl = hc.controller(kv, io_threads=4, batch_pages=8, path=io_path)
        hashes = self.make_page_hashes(n)
        salts = list(range(1, workers + 1))
        for t, salt in enumerate(salts):
            hc.fill(kv, range(n * (t + 1), n * (t + 2)), hashes, salt=salt)
        problems: list[str] = []

        def worker(t: int) -> None:
            rng = random.Random(t)
            src = n * (t + 1)
            dst_base = n * (workers + 1 + t)
            try:
                for _ in range(rounds):
                    a = rng.randrange(0, n // 2)
                    b = rng.randrange(a + 1, n + 1)
                    pending = ctl.backup_async(hashes[a:b], list(range(src + a, src + b)))
                    k = rng.randrange(1, n + 1)
                    dst = list(range(dst_base, dst_base + k))
                    hc.sentinel(kv, dst)
                    res = ctl.prefetch_async(hashes[:k], dst).result()
                    got = _versions(hc, kv, dst[: res.pages], hashes[: res.pages], salts)
                    if not all(got):
                        problems.append(
                            f"thread {t}: prefetch reported {res.pages} pages, wrong bytes: {got}"
                        )
                    done = pending.result(timeout=60)
                    if done.errors or done.pages != b - a:
                        problems.append(f"thread {t}: backup of pages {a}..{b}: {done}")
            except Exception as err:  # reported below; a worker must never die silently
                problems.append(f"thread {t}: {type(err).__name__}: {err}")

        _run([threading.Thread(target=worker, args=(t,)) for t in range(workers)])
        assert not problems, "; ".join(problems[:5])
        res = ctl.backup(hashes, list(range(n, 2 * n)))
        assert res.pages == n, f"R36: backup of {n} pages after the concurrent phase: {res}"
        found = ctl.query(hashes).pages
        assert found == n, (
            f"R36: after threads backed up all {n} pages at once (and once more alone), query finds {found}: "
            "a page a concurrent SET reported True is missing"
        )
        dst = list(range(0, n))
        hc.sentinel(kv, dst)
        res = ctl.prefetch(hashes, dst)
        assert res.pages == n, (
            f"R36: prefetch of {n} pages after the concurrent phase restored {res.pages}: {res}"
        )
        expect_flags(_versions(hc, kv, dst, hashes, salts), [True] * n, "bytes after the concurrent phase")

    @rule("R18", "R36")
    def test_concurrency_raw_threads(self, hc: SuiteContext, io_path: str) -> None:
        """R18, R36: Threads calling set (each its own bytes) / exists / get on one store at once get correct
        per-page results, and every page read holds one writer's bytes, whole."""
        hc.canary.enabled = False
        n, workers = 16, 4
        store, pool = hc.kv_store("mha", n * (2 * workers))
        hashes = self.make_page_hashes(n)
        salts = list(range(1, workers + 1))
        for t, salt in enumerate(salts):
            hc.fill(pool, range(n * t, n * (t + 1)), hashes, salt=salt)
        problems: list[str] = []

        def worker(t: int) -> None:
            rng = random.Random(100 + t)
            src, base = n * t, n * (workers + t)
            try:
                for _ in range(4):
                    sel = sorted(rng.sample(range(n), rng.randrange(1, n)))
                    sh = [hashes[i] for i in sel]
                    if not all(hc.raw(store, IoOp.SET, KV, pool, sh, [src + i for i in sel], io_path)):
                        problems.append(f"thread {t}: set failed")
                    if not all(hc.raw(store, IoOp.EXISTS, KV, pool, sh, sel, io_path)):
                        problems.append(f"thread {t}: pages just set do not exist")
                    dst = [base + i for i in sel]
                    hc.sentinel(pool, dst)
                    ok = hc.raw(store, IoOp.GET, KV, pool, sh, dst, io_path)
                    if not all(ok) or not all(_versions(hc, pool, dst, sh, salts)):
                        problems.append(f"thread {t}: get {ok.count(False)} misses or torn / wrong bytes")
            except Exception as err:
                problems.append(f"thread {t}: {type(err).__name__}: {err}")

        _run([threading.Thread(target=worker, args=(t,)) for t in range(workers)])
        assert not problems, "; ".join(problems[:5])

    @rule("R18")
    def test_concurrency_no_torn_pages(self, hc: SuiteContext, io_path: str) -> None:
        """R18: Writers re-set the same big pages (``torn_component_bytes`` per component) with bytes of
        their own while readers read them: every read is whole, one writer's bytes per component,
        never a mix (a torn or in-place write). Runs until enough reads overlapped a write."""
        hc.canary.enabled = False
        layers, heads, itemsize = 8, 8, 2
        head_dim = max(1, self.torn_component_bytes // (self.page_size * layers * heads * itemsize))
        slots = TORN_PAGES * (TORN_WRITERS + TORN_READERS)
        pool = MHAKVPool(slots, self.page_size, layers, heads, head_dim, torch.bfloat16)
        store = hc.open()
        store.register_pool(KV, pool)
        torn = _TornRounds(hc, store, pool, io_path)
        overlaps = rounds = 0
        deadline = time.monotonic() + TORN_BUDGET_S
        while rounds < TORN_MIN_ROUNDS or (overlaps < TORN_MIN_OVERLAPS and time.monotonic() < deadline):
            overlaps += torn.round(self.make_page_hashes(TORN_PAGES, salt=9000 + rounds), rounds)
            rounds += 1
        assert overlaps >= TORN_MIN_OVERLAPS, (
            f"only {overlaps} reads overlapped a write in {rounds} rounds ({TORN_BUDGET_S:g}s); the check "
            "cannot tell whether writes are atomic (lower the load on this machine)"
        )


class _TornRounds:
    """One round of ``test_concurrency_no_torn_pages``: fresh pages, writers and readers at once."""

    def __init__(self, hc: SuiteContext, store: Store, pool: HostPool, path: str) -> None:
        self.hc, self.store, self.pool, self.path = hc, store, pool, path
        self.writer_slots = [list(range(w * TORN_PAGES, (w + 1) * TORN_PAGES)) for w in range(TORN_WRITERS)]
        first = TORN_WRITERS * TORN_PAGES
        self.reader_slots = [
            list(range(first + r * TORN_PAGES, first + (r + 1) * TORN_PAGES)) for r in range(TORN_READERS)
        ]
        self.lock = threading.Lock()
        self.problems: list[str] = []

    def whole(self, dst: Sequence[int], pages: Sequence[int]) -> list[str]:
        """Components of host slots ``dst`` (holding pages ``pages``) that are no writer's bytes."""
        bad = []
        for p, views in zip(pages, self.pool.page_views(dst)):
            for c, view in enumerate(views):
                versions = [self.pool.page_views([w[p]])[0][c] for w in self.writer_slots]
                if not any(torch.equal(view, v) for v in versions):
                    bad.append(f"page {p} component {self.pool.components[c]!r}")
        return bad

    def round(self, hashes: list[str], n: int) -> int:
        """Run one round over ``hashes``; returns how many successful reads overlapped a write."""
        hc, pool = self.hc, self.pool
        for w, ws in enumerate(self.writer_slots):
            if n == 0:  # seeded random bytes, distinct per writer; each round adds 1 to every byte
                hc.fill(pool, ws, hashes, salt=w + 1)
            else:
                for views in pool.page_views(ws):
                    for view in views:
                        view.add_(1)
        self.hashes = hashes
        self.active = [0, 0]  # writes in progress, writes finished
        self.overlaps = 0
        self.writing = threading.Event()
        self.writing.set()
        readers = [threading.Thread(target=self.reader, args=(r,)) for r in range(TORN_READERS)]
        for th in readers:
            th.start()
        _run([threading.Thread(target=self.writer, args=(w,)) for w in range(TORN_WRITERS)])
        self.writing.clear()
        for th in readers:
            th.join(timeout=JOIN_TIMEOUT_S)
        assert not self.problems, "; ".join(self.problems[:4])
        dst = self.reader_slots[0]
        hc.sentinel(pool, dst)
        final = hc.raw(self.store, IoOp.GET, KV, pool, hashes, dst, self.path)
        expect_flags(final, [True] * TORN_PAGES, f"round {n}: get after the writers finished")
        bad = self.whole(dst, range(TORN_PAGES))
        assert not bad, f"round {n}: concurrent sets left pages that are no single writer's: {bad}"
        return self.overlaps

    def writer(self, w: int) -> None:
        try:
            for _ in range(TORN_MAX_SETS):
                if self.overlaps >= TORN_ROUND_OVERLAPS:
                    break
                with self.lock:
                    self.active[0] += 1
                try:
                    ok = self.hc.raw(
                        self.store, IoOp.SET, KV, self.pool, self.hashes, self.writer_slots[w], self.path
                    )
                finally:
                    with self.lock:
                        self.active[0] -= 1
                        self.active[1] += 1
                if not all(ok):
                    self.problems.append(f"writer {w}: set reported {ok}")
        except Exception as err:
            self.problems.append(f"writer {w}: {type(err).__name__}: {err}")

    def reader(self, r: int) -> None:
        dst = self.reader_slots[r]
        try:
            while self.writing.is_set():
                self.hc.sentinel(self.pool, dst)
                with self.lock:
                    before = tuple(self.active)
                ok = self.hc.raw(self.store, IoOp.GET, KV, self.pool, self.hashes, dst, self.path)
                with self.lock:
                    during = before[0] > 0 or self.active[0] > 0 or self.active[1] != before[1]
                got = [p for p, f in enumerate(ok) if f]
                bad = self.whole([dst[p] for p in got], got)
                if bad:
                    self.problems.append(
                        f"reader {r}: a {self.path} get run during sets reported pages whose bytes are "
                        f"no single writer's (a torn or in-place write): {bad}"
                    )
                    return
                if during and got:
                    with self.lock:
                        self.overlaps += 1
        except Exception as err:
            self.problems.append(f"reader {r}: {type(err).__name__}: {err}")
