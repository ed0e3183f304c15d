"""Child processes of the reliability suite: ``python -m tests.reliability._worker MODE [JSON]``.

``zygote``: imports torch and hicache once, then forks a fresh child per command read from
stdin (one JSON object per line, one JSON reply per line), so each crash round costs a fork
instead of an interpreter start:

* ``{"op": "writer", ...}``: a child that backs pages up in a loop until it is killed,
  logging ``start B`` / ``done B PAGES`` per batch to ``progress`` (line-buffered, so the
  log survives SIGKILL); reply ``{"pid": PID}``.
* ``{"op": "reap", "pid": PID}``: wait for a killed child; reply ``{"status": STATUS}``.
* ``{"op": "verify", ...}``: a child that opens the store afresh and checks pages; reply
  ``{"status": STATUS, "result": {...}}``.

``concurrency``: 8 threads backing up and prefetching overlapping pages, verifying bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from tests.reliability._util import (
    GEOMETRY,
    backend_name,
    fill_pages,
    hex_hash,
    page_bytes,
    page_matches,
    store_options,
)


def _controller(backend: str, root: str, pages: int, **settings: Any) -> Any:
    import hicache_core as hc

    cfg = hc.StorageConfig(
        backend=backend_name(backend),
        options=store_options(backend, Path(root)),
        model_name="reliability",
        **settings,
    )
    return hc.CacheController(cfg, hc.HostPoolGroup(hc.MHAKVPool(pages, **GEOMETRY)))


def writer(backend: str, root: str, ns: str, progress: str, batch: int) -> None:
    ctl = _controller(backend, root, batch)
    pool = ctl.pools.anchor
    with open(progress, "a", buffering=1) as log:
        log.write("ready\n")
        for b in itertools.count():
            hashes = [hex_hash(ns, b * batch + i) for i in range(batch)]
            fill_pages(pool, range(batch), hashes)
            log.write(f"start {b}\n")
            res = ctl.backup(hashes, range(batch))
            log.write(f"done {b} {res.pages}\n")


def verify(backend: str, root: str, hashes: list[str], must_exist: list[str]) -> dict[str, Any]:
    """Open the store afresh; every page reported present must read back byte-exact."""
    from hicache_core import IoOp, PoolName

    chunk = 64
    ctl = _controller(backend, root, chunk)
    store, pool = ctl.store, ctl.pools.anchor
    required = set(must_exist)
    out = {
        "checked": 0,
        "present": 0,
        "partial": 0,
        "bytes_verified": 0,
        "torn": 0,
        "unreadable": 0,
        "lost": 0,
    }
    try:
        for s in range(0, len(hashes), chunk):
            part = hashes[s : s + chunk]
            keys = store.page_keys(PoolName.KV, part)
            flat = [k for ks in keys for k in ks]
            exists = store.batch_io_v1(IoOp.EXISTS, flat)
            for b in pool.buffers():
                b.fill_(0xA5)
            views = [v for page in pool.page_views(range(len(part))) for v in page]
            got = store.batch_io_v1(IoOp.GET, flat, views)
            c = len(pool.components)
            for i, h in enumerate(part):
                ex, ok = exists[i * c : i * c + c], got[i * c : i * c + c]
                out["checked"] += 1
                if all(ex):
                    out["present"] += 1
                elif any(ex):
                    out["partial"] += 1  # components are separate objects; the page is a miss
                if any(e and not g for e, g in zip(ex, ok)):
                    out["unreadable"] += 1
                if all(ok):
                    if page_matches(pool, i, h):
                        out["bytes_verified"] += pool.page_nbytes
                    else:
                        out["torn"] += 1
                elif any(ok):
                    for comp, (g, v) in enumerate(zip(ok, pool.page_views([i])[0])):
                        if g and v.contiguous().numpy().tobytes() != page_bytes(
                            h, comp, pool.component_nbytes[comp]
                        ):
                            out["torn"] += 1
                if h in required and not all(ok):
                    out["lost"] += 1
        out["integrity_errors"] = int(getattr(store.backend, "integrity_errors", 0) or 0)
    finally:
        ctl.close()
    return out


def zygote() -> None:
    import torch  # noqa: F401  (imported once, before any fork)

    import hicache_core
    from hicache_core.plugin.registry import load_backend_class

    hicache_core.StorageConfig()  # pydantic models built
    for name in ("file", "hf3fs"):  # import the backends once; each child only opens a store
        try:
            load_backend_class(name)
        except hicache_core.HiCacheError:
            pass

    out = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "reap":
            _, status = os.waitpid(cmd["pid"], 0)
            reply: dict[str, Any] = {"status": status}
        else:
            result_path = cmd.pop("result_path", None)
            pid = os.fork()
            if pid == 0:  # the fresh process
                code = 0
                try:
                    with contextlib.suppress(Exception):  # die with the zygote (PR_SET_PDEATHSIG)
                        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
                    os.dup2(2, 1)  # keep the protocol channel clean
                    if op == "writer":
                        writer(**cmd)
                    else:
                        Path(result_path).write_text(json.dumps(verify(**cmd)))
                except BaseException:
                    traceback.print_exc()
                    code = 3
                finally:
                    os._exit(code)
            if op == "writer":
                reply = {"pid": pid}
            else:
                _, status = os.waitpid(pid, 0)
                text = Path(result_path).read_text() if status == 0 else "null"
                reply = {"status": status, "result": json.loads(text)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def concurrency(
    backend: str, root: str, threads: int, rounds: int, span: int, window: int, seed: int
) -> dict[str, Any]:
    """``threads`` threads share one controller; each backs up and prefetches random windows."""
    ctl = _controller(backend, root, 2 * threads * window, io_threads=4)
    pool = ctl.pools.anchor
    hashes = [hex_hash("concurrency", i) for i in range(span)]
    counts = {"backups": 0, "prefetches": 0, "pages_written": 0, "pages_read": 0, "bytes_verified": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        rng = random.Random(seed * 1000 + t)
        src = list(range(2 * t * window, (2 * t + 1) * window))
        dst = list(range((2 * t + 1) * window, (2 * t + 2) * window))
        for _ in range(rounds):
            start = rng.randrange(0, span - window)
            part = hashes[start : start + window]
            fill_pages(pool, src, part)
            res = ctl.backup(part, src)
            got = ctl.prefetch(part, dst)
            bad = [h for i, h in enumerate(part[: got.pages]) if not page_matches(pool, dst[i], h)]
            with lock:
                counts["backups"] += 1
                counts["prefetches"] += 1
                counts["pages_written"] += res.pages - res.skipped
                counts["pages_read"] += got.pages
                counts["bytes_verified"] += (got.pages - len(bad)) * pool.page_nbytes
                if bad or res.errors or got.errors or res.pages != window:
                    errors.append(
                        f"thread {t}: {len(bad)} corrupt, backup {res.pages}/{window} {res.errors} {got.errors}"
                    )

    t0 = time.monotonic()
    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    ctl.close()
    return {**counts, "errors": errors, "seconds": time.monotonic() - t0}


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "zygote":
        zygote()
    elif mode == "concurrency":
        print(json.dumps(concurrency(**json.loads(sys.argv[2]))))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
