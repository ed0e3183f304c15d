"""Defects that each path or store hides from itself: host memory written by a SET or after a call
returns, zero pages, files outside the storage reached through symlinks or a hostile model name,
and threads or file descriptors left behind by closed stores.

Each of these was once written by a backend author from the guide and passed every other test:
a SET that zeroes its source pages after copying them out, a GET that writes its target again
after it returned, an all-zero component stored as an empty marker that EXISTS then ignores, a
GET that follows a symlink planted in the root, a root split per ``model_name`` (so ``"../x"`` or
an absolute model name leaves it), a store that starts a thread and opens a file per instance and
never releases them.
"""

from __future__ import annotations

import gc
import os
import stat
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from hicache_core import (
    DraftOffloadDisabledWarning,
    HiCacheError,
    HostPool,
    HostPoolGroup,
    IoOp,
    PoolName,
    Store,
    open_store,
)

from ._base import SuiteBase
from ._context import SuiteContext, expect_flags
from ._options import path_option_names
from ._rules import rule

__all__ = ["GuardTests"]

KV = PoolName.KV
LATE_S = 0.1  # how long a test waits for writes into host memory after a call returned
CYCLES = 10  # stores opened and closed by test_discovery_close_releases
THREAD_SLACK, FD_SLACK = 2, 3  # what other machinery of the process may start or open meanwhile
SETTLE_S = 2.0  # how long closed stores' threads get to end


def _changed_pages(old: torch.Tensor, new: torch.Tensor, pool: HostPool) -> list[int]:
    """Host pages (indices along the page dimension) whose bytes differ between two buffers."""
    pd = 0 if pool.layout.value == "page_first" else 1
    diff = (old != new).transpose(0, pd).reshape(old.shape[pd], -1).any(1)
    return [int(i) for i in diff.nonzero().flatten().tolist()]


def _snapshot(pools: Mapping[PoolName, HostPool]) -> dict[PoolName, list[torch.Tensor]]:
    return {name: [b.clone() for b in pool.buffers()] for name, pool in pools.items()}


def _host_changes(
    before: Mapping[PoolName, list[torch.Tensor]], pools: Mapping[PoolName, HostPool]
) -> list[str]:
    """What changed in the pools' host memory since ``before`` (one entry per pool component)."""
    out = []
    for name, pool in pools.items():
        for comp, old, new in zip(pool.components, before[name], pool.buffers()):
            if not torch.equal(old, new):
                out.append(
                    f"pool {name.value!r} component {comp!r} pages {_changed_pages(old, new, pool)[:12]}"
                )
    return out


class GuardTests(SuiteBase):
    """Groups ``bytes``, ``errors`` and ``discovery``: what no other test of those groups sees."""

    def _all_pools(self, hc: SuiteContext, n: int) -> tuple[Store, dict[PoolName, HostPool]]:
        store = hc.open()
        pools = self.declared_pools(hc.caps.pools, n)
        for name, pool in pools.items():
            store.register_pool(name, pool)
        return store, pools

    # ------------------------------------------------------------------ bytes
    @rule("R38")
    def test_bytes_set_leaves_host_memory(self, hc: SuiteContext, io_path: str) -> None:
        """R38: "Host memory is read-only to SET and EXISTS [...]". Every declared pool, every page
        filled; raw SET and EXISTS of each pool, then a controller's backup of all of them: every
        byte of every pool is unchanged afterwards."""
        n = 4
        store, pools = self._all_pools(hc, 2 * n)
        hashes = self.make_page_hashes(2 * n, salt=380)
        for i, pool in enumerate(pools.values()):
            hc.fill(pool, range(2 * n), hashes, salt=i)
        before = _snapshot(pools)
        for name, pool in pools.items():
            hc.raw(store, IoOp.SET, name, pool, hashes[:n], range(n), io_path)
            hc.raw(store, IoOp.EXISTS, name, pool, hashes, range(2 * n), io_path)
        changed = _host_changes(before, pools)
        assert not changed, (
            f"R38: backend {hc.name!r}: a {io_path} SET or EXISTS wrote host memory: {'; '.join(changed)}. "
            "Host pages are the engine's: copy the bytes out and never write, zero or reuse them"
        )
        group = self.declared_pools(hc.caps.pools, 2 * n)
        extra: dict[PoolName | str, HostPool] = {name: pool for name, pool in group.items() if name is not KV}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DraftOffloadDisabledWarning)
            ctl = hc.controller(HostPoolGroup(group[KV], extra), path=io_path)
        for i, pool in enumerate(group.values()):
            hc.fill(pool, range(2 * n), hashes, salt=10 + i)
        before = _snapshot(group)
        slots: dict[PoolName | str, list[int]] | None = (
            {PoolName.MAMBA: [n - 1]} if PoolName.MAMBA in group else None
        )
        res = ctl.backup(hashes[n:], list(range(n)), extra=slots)
        assert res.pages == n, f"backup of {n} new pages of every declared pool: {res}"
        changed = _host_changes(before, group)
        assert not changed, (
            f"R38: backend {hc.name!r}: a backup over {io_path} wrote host memory: {'; '.join(changed)}. "
            "Host pages are the engine's: copy the bytes out and never write, zero or reuse them"
        )

    @rule("R11", "R15", "R17")
    def test_bytes_zero_pages(self, hc: SuiteContext, io_path: str) -> None:
        """R11, R15, R17: a page of zero bytes, and a page whose first component is all zeros, are
        pages like any other: SET ``True``, then EXISTS ``True`` and GET exact, in every declared
        pool (a backend may store them compactly, never report them absent)."""
        n = 3
        store, pools = self._all_pools(hc, 2 * n)
        hashes = self.make_page_hashes(n, salt=381)
        for i, (name, pool) in enumerate(pools.items()):
            hc.fill(pool, range(n), hashes, salt=i)
            for view in pool.page_views([0])[0]:
                view.zero_()
            pool.page_views([1])[0][0].zero_()
            expected = [[v.clone() for v in views] for views in pool.page_views(range(n))]
            what = f"{io_path} {name.value} pages [all zeros, first component zeros, random]"
            expect_flags(
                hc.raw(store, IoOp.SET, name, pool, hashes, range(n), io_path), [True] * n, f"{what}: set"
            )
            found = hc.raw(store, IoOp.EXISTS, name, pool, hashes, range(n), io_path)
            if not all(found):
                raise AssertionError(
                    f"R15/R17: backend {hc.name!r}: {what}: exists after a successful set says {found}; a "
                    "page of zeros is stored like any other (an empty marker file must count as present)"
                )
            got = hc.read(store, name, pool, hashes, range(n, 2 * n), io_path)
            expect_flags(got, [True] * n, f"{what}: get")
            for p, views in enumerate(pool.page_views(range(n, 2 * n))):
                for comp, view, exp in zip(pool.components, views, expected[p]):
                    assert torch.equal(view, exp), (
                        f"R11: {what}: page {p} component {comp!r} differs after get"
                    )

    @rule("R20", "R12")
    def test_bytes_nothing_after_return(self, hc: SuiteContext, io_path: str) -> None:
        """R20, R12: R20: "Buffers are lent for the call only: a backend never keeps a reference to
        one or touches it after the hook returns (SET copies the bytes out)". The source pages are
        overwritten right after the SET returned and the target pages right after the GET returned;
        nothing in the pool changes while the test waits, and the stored bytes are the ones the SET
        was given."""
        n = 4
        store, pool = hc.kv_store("mha", 2 * n)
        hashes, src, dst = self.make_page_hashes(n, salt=382), list(range(n)), list(range(n, 2 * n))
        hc.write(store, KV, pool, hashes, src, path=io_path)
        for views in pool.page_views(src):
            for view in views:
                view.fill_(0x3C)
        expect_flags(hc.read(store, KV, pool, hashes, dst, io_path), [True] * n, f"{io_path} get")
        expect_flags(hc.matches(pool, dst, hashes), [True] * n, f"{io_path} bytes after get")
        for views in pool.page_views(dst):
            for view in views:
                view.fill_(0x5A)
        before = _snapshot({KV: pool})
        time.sleep(LATE_S)
        changed = _host_changes(before, {KV: pool})
        assert not changed, (
            f"R20/R12: backend {hc.name!r}: host memory changed after {io_path} SET and GET had returned "
            f"({'; '.join(changed)}): a hook may touch its buffers only until it returns (no timer, "
            "thread or deferred copy may keep a reference to one)"
        )
        expect_flags(hc.read(store, KV, pool, hashes, dst, io_path), [True] * n, f"{io_path} get again")
        got = hc.matches(pool, dst, hashes)
        assert all(got), (
            f"R20: backend {hc.name!r}: pages read back over {io_path} are not the bytes the SET was given "
            f"({got}): the source pages were overwritten after SET returned, so SET must copy the bytes "
            "out before it returns"
        )

    # ----------------------------------------------------------------- errors
    def _path_dirs(self, hc: SuiteContext) -> list[Path]:
        fields = getattr(hc.cls.Options, "model_fields", {})  # type: ignore[attr-defined]
        names = {*path_option_names(hc.cls), *(f for f in self.tmp_dir_options if f in fields)}
        return [
            Path(str(hc.options[f]))
            for f in sorted(names)
            if isinstance(hc.options.get(f), (str, os.PathLike))
        ]

    @rule("R25", "R11")
    def test_errors_symlinked_files(self, hc: SuiteContext, io_path: str, tmp_path: Path) -> None:
        """R25, R11: after a SET, every regular file under the storage root is replaced by a symlink to
        a file outside the root holding other bytes of the same size; a GET (this store's and a new
        store's) never loads those bytes: a page is a miss or holds the bytes stored (a typed
        ``HiCacheError`` refusing the storage is fine too)."""
        if not hc.isolated:
            pytest.skip("the storage is not a per-test directory (options name it): no files are replaced")
        n = 4
        store, pool = hc.kv_store("mha", 2 * n)
        hashes, src, dst = self.make_page_hashes(n, salt=383), list(range(n)), list(range(n, 2 * n))
        hc.write(store, KV, pool, hashes, src, path=io_path)
        roots = [d for d in self._path_dirs(hc) if d.is_dir() and not d.is_symlink()]
        if not roots:
            pytest.skip(f"backend {hc.name!r} has no path option naming a storage directory")
        outside = tmp_path / "outside-the-root"
        outside.mkdir()
        planted = 0
        for root in roots:
            for dirpath, _, files in os.walk(root):
                for name in files:
                    path = os.path.join(dirpath, name)
                    if not stat.S_ISREG(os.lstat(path).st_mode):
                        continue
                    with open(path, "rb") as f:
                        data = f.read()
                    target = outside / f"f{planted}"
                    target.write_bytes(_invert(data))
                    link = os.path.join(dirpath, f".{name}.symlink")
                    os.symlink(target, link)
                    os.replace(link, path)
                    planted += 1
        if not planted:
            pytest.skip(f"backend {hc.name!r} wrote no regular file under {[str(r) for r in roots]}")
        readers: list[tuple[str, Store, HostPool]] = [("the store that wrote", store, pool)]
        try:
            fresh, pool2 = hc.kv_store("mha", 2 * n)
            readers.append(("a new store", fresh, pool2))
        except HiCacheError:
            pass  # refusing to open storage holding symlinks is fine
        for who, st, p in readers:
            try:
                got = hc.read(st, KV, p, hashes, dst, io_path)
            except HiCacheError:
                continue  # a typed refusal loads nothing
            exact = hc.matches(p, dst, hashes)
            wrong = [i for i in range(n) if got[i] and not exact[i]]
            assert not wrong, (
                f"R25: backend {hc.name!r}: {io_path} GET through {who} reported pages {wrong} with bytes "
                f"that are not the stored ones after the {planted} files under the storage root were "
                f"replaced by symlinks to files outside it ({outside}): open with O_NOFOLLOW and "
                "check with os.lstat, never follow a link out of the root"
            )

    @rule("R25")
    def test_errors_hostile_model_name(self, hc: SuiteContext, tmp_path: Path) -> None:
        """R25: configs whose ``model_name`` is ``"../esc-<token>"`` or an absolute path write nothing
        outside the storage (next to the root, in the working directory or at that path); the
        model name is identity, never a path."""
        token = uuid.uuid4().hex[:10]
        absolute = tmp_path / f"abs-{token}"
        hostile = [f"../esc-{token}", f"../../esc-{token}", str(absolute), f"{absolute}/sub"]
        opened = 0
        for model_name in hostile:
            try:
                store = hc.open(model_name=model_name)
            except (HiCacheError, ValueError):
                continue  # refusing such a config is fine
            opened += 1
            pool = self.make_kv_pool("mha", 2)
            store.register_pool(KV, pool)
            hashes = self.make_page_hashes(2, salt=384)
            hc.fill(pool, [0, 1], hashes)
            for path in hc.paths:
                hc.raw(store, IoOp.SET, KV, pool, hashes, [0, 1], path)
                hc.raw(store, IoOp.EXISTS, KV, pool, hashes, [0, 1], path)
            store.close()
        if not opened:
            pytest.skip("StorageConfig or the backend refuses every hostile model name")
        look = {Path.cwd(), Path.cwd().parent, tmp_path}
        for d in self._path_dirs(hc):
            look |= {d.parent, d.parent.parent}
        escaped = sorted(str(d / e) for d in look if d.is_dir() for e in os.listdir(d) if token in e)
        assert not escaped, (
            f"R25: backend {hc.name!r}: stores opened with model names {hostile} created {escaped}, outside "
            "the storage: never build a path from the config's identity fields (model_name, revision); "
            "key objects by the keys the store passes (check_keys) under the root"
        )

    # -------------------------------------------------------------- discovery
    @rule("R2")
    def test_discovery_close_releases(self, hc: SuiteContext) -> None:
        """R2: "`hicache_close` releases what it opened": after one store was opened and closed, opening
        and closing 10 more (each registering a pool and moving a page) leaves no more threads
        and open file descriptors than before, within a small slack for the rest of the process."""
        hashes = self.make_page_hashes(1, salt=385)
        hc.kv_store("mha", 2)  # stays open: process-wide resources of the backend stay warm

        def cycle() -> None:
            # open_store, not hc.open: nothing keeps the closed store alive, so what a backend
            # releases when it is garbage-collected is not counted as left behind
            store = open_store(hc.config())
            try:
                pool = self.make_kv_pool("mha", 2)
                store.register_pool(KV, pool)
                hc.write(store, KV, pool, hashes, [0])
                hc.read(store, KV, pool, hashes, [1])
                if not hc.isolated and callable(getattr(hc.cls, "hicache_clear", None)):
                    store.clear()
            finally:
                store.close()

        cycle()  # one-time costs: module-level pools, lazily started workers
        gc.collect()
        threads0, fds0 = _census()
        for _ in range(CYCLES):
            cycle()
        deadline = time.monotonic() + SETTLE_S
        while True:
            gc.collect()
            threads, fds = _census()
            new_threads = [t for t in threading.enumerate() if t.ident in threads - threads0]
            new_fds = sorted(fds - fds0)
            settled = len(new_threads) <= THREAD_SLACK and len(new_fds) <= FD_SLACK
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(new_threads) <= THREAD_SLACK, (
            f"R2: backend {hc.name!r}: {CYCLES} stores opened and closed left {len(new_threads)} threads "
            f"running ({sorted({t.name for t in new_threads})[:6]}): hicache_close must stop (and join) "
            "every thread the backend started"
        )
        assert len(new_fds) <= FD_SLACK, (
            f"R2: backend {hc.name!r}: {CYCLES} stores opened and closed left {len(new_fds)} file "
            f"descriptors open ({[_fd_target(fd) for fd in new_fds[:6]]}): hicache_close must close every "
            "file, socket or handle the backend opened"
        )


def _invert(data: bytes) -> bytes:
    """Other bytes of the same size (every bit flipped)."""
    if not data:
        return data
    return (torch.frombuffer(bytearray(data), dtype=torch.uint8) ^ 0xFF).numpy().tobytes()


def _census() -> tuple[set[int | None], set[str]]:
    """Live Python threads (idents) and open file descriptors (Linux; empty elsewhere)."""
    threads = {t.ident for t in threading.enumerate() if t.is_alive()}
    try:
        fds = set(os.listdir("/proc/self/fd"))
    except OSError:
        fds = set()
    return threads, fds


def _fd_target(fd: str) -> str:
    try:
        return f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"
    except OSError:
        return fd
