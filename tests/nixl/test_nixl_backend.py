"""The nixl backend beyond the conformance suite: options, install and credential errors, the
zero-copy and O_DIRECT paths, engine choice, path safety, orphan clean-up, per-page failures."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hicache_nixl import NixlBackend, _agent, _backend, _format
from nixl_util import S3Server, controller, fill, hex_hash, kv_pool, matches

import hicache_core as hc
from hicache_core import BackendIOError, BackendUnavailableError, IoOp, OptionsError, PoolName, StorageConfig


def _roundtrip(options: dict[str, Any], pages: int = 6, layout: str = "page_first", **pool_kw: Any) -> None:
    hashes = [hex_hash(f"rt-{layout}", i) for i in range(pages)]
    pool = kv_pool(pages, layout=layout, **pool_kw)
    with controller(options, pool, layout=layout) as ctl:
        fill(pool, list(range(pages)), hashes)
        assert ctl.backup(hashes, range(pages)).pages == pages
        for b in pool.buffers():
            b.zero_()
        assert ctl.prefetch(hashes, range(pages)).pages == pages
        assert all(matches(pool, i, h) for i, h in enumerate(hashes))


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"roots": "/x"}, "roots"),
        ({"plugin": "obj"}, "bucket"),
        ({"plugin": "s3"}, "plugin"),
        ({"engine": "posix_aio"}, "engine"),
        ({"plugin": "obj", "bucket": "b", "endpoint": "http://127.0.0.1:1"}, "bucket"),
        ({"plugin": "obj", "bucket": "bkt", "endpoint": "http://user:pw@127.0.0.1:1"}, "endpoint"),
        ({"plugin": "obj", "bucket": "bkt", "endpoint": "ftp://127.0.0.1"}, "endpoint"),
        ({"prefix": "../up"}, "prefix"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_options_name_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(OptionsError) as err:
        hc.open_store(StorageConfig(backend="nixl", options=options))
    assert field in str(err.value) and "nixl" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_engine_not_offered_by_this_nixl(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_agent.Agent, "plugin_params", lambda self, plugin: {"use_aio": "false"})
    with pytest.raises(OptionsError, match=r"engine='uring'.*offers: aio"):
        hc.open_store(StorageConfig(backend="nixl", options={"root": str(tmp_path), "engine": "uring"}))


# ------------------------------------------------------------------ install, credentials
def test_missing_nixl_is_unavailable_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_agent, "MODULES", ("hicache_no_such_nixl",))
    reason = NixlBackend.availability()
    assert reason is not None and "`pip install hicache-nixl`" in reason
    with pytest.raises(BackendUnavailableError) as err:
        hc.open_store(StorageConfig(backend="nixl"))
    assert "pip install hicache-nixl" in str(err.value) and isinstance(err.value, ImportError)
    with pytest.raises(BackendUnavailableError, match="pip install hicache-nixl"):
        _agent.load_api()


def test_obj_without_credentials_says_which_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    opts = {"plugin": "obj", "bucket": "hicache-x", "endpoint": "http://127.0.0.1:9"}
    with pytest.raises(BackendUnavailableError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        hc.open_store(StorageConfig(backend="nixl", options=opts))


def test_credentials_never_logged_shown_or_in_errors(
    s3_server: S3Server,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    secret = "hicache-SeCrEt-6d1f0c"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG)
    pool = kv_pool(4)
    hashes = [hex_hash("cred", i) for i in range(4)]
    with controller(s3_server.options(s3_bucket), pool) as ctl:
        fill(pool, [0, 1], hashes[:2])
        assert ctl.backup(hashes[:2], [0, 1]).pages == 2
        assert ctl.prefetch(hashes, range(4)).pages == 2  # two misses: logged failures
        shown = [repr(ctl.store.backend), repr(ctl.store.backend.options), str(ctl.config.model_dump())]
    out, err = capfd.readouterr()
    for text in [*shown, caplog.text, out, err]:
        assert secret not in text


# -------------------------------------------------------------------- zero-copy paths
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_posix_moves_registered_pool_memory_without_a_copy(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_bounce(nbytes: int, align: int = 4096) -> Any:
        if nbytes >= 4096 * 2:  # headers are 4 KiB each; a page buffer would be another size
            pytest.fail(f"a bounce buffer of {nbytes} bytes was allocated for registered pool memory")
        return real(nbytes, align)

    real = _format.aligned_empty
    monkeypatch.setattr(_format, "aligned_empty", no_bounce)  # imported where used ...
    monkeypatch.setattr(_backend, "aligned_empty", no_bounce, raising=False)  # ... or at module level
    _roundtrip({"root": str(tmp_path)}, layout=layout)


def test_adjacent_components_move_as_one_run_per_registered_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page_first batch goes as one descriptor per pool buffer (its pages are adjacent in memory
    and placed so in the segment), never one spanning two registered buffers (NIXL refuses it)."""
    real = _agent.Agent.transfer
    seen: list[tuple[str, list[int], bool]] = []

    def spy(self: Any, op: str, local: Any, remote: Any, mem: str, keep: Any = None) -> bool:
        ok = real(self, op, local, remote, mem, keep)
        seen.append((op, [n for _, n, _ in local], ok))
        return ok

    monkeypatch.setattr(_agent.Agent, "transfer", spy)
    _roundtrip({"root": str(tmp_path)}, pages=6)  # components of 8 KiB: a K run and a V run of 48 KiB
    assert [op for op, _, _ in seen] == ["WRITE", "READ"]
    assert all(ok and sizes == [6 * 8192, 6 * 8192] for _, sizes, ok in seen), seen


def _aligned_pool(pages: int) -> Any:
    pool = kv_pool(pages, allocate=False)
    raw = torch.zeros(pool.nbytes + 4096, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 4096
    pool.bind(raw[off : off + pool.nbytes])
    return pool, raw


def test_o_direct_is_used_for_aligned_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flags: list[int] = []
    real_open = os.open

    def spy(path: Any, flag: int, *args: Any, **kw: Any) -> int:
        flags.append(flag)
        return real_open(path, flag, *args, **kw)

    pool, _keep = _aligned_pool(4)
    hashes = [hex_hash("direct", i) for i in range(4)]
    with controller({"root": str(tmp_path), "o_direct": True}, pool) as ctl:
        monkeypatch.setattr(os, "open", spy)
        fill(pool, list(range(4)), hashes)
        assert ctl.backup(hashes, range(4)).pages == 4
        pool.buffers()[0].zero_()
        assert ctl.prefetch(hashes, range(4)).pages == 4
        monkeypatch.undo()
        assert all(matches(pool, i, h) for i, h in enumerate(hashes))
    assert sum(1 for f in flags if f & os.O_DIRECT) >= 2  # the batch's segment, written then read


def test_uring_refused_falls_back_to_aio_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = _agent.Agent.create

    def refuse_uring(self: Any, plugin: str, params: dict[str, str]) -> None:
        if params.get("use_uring") == "true":
            raise BackendIOError("NIXL could not create its POSIX plugin (io_uring_setup: EPERM)")
        real(self, plugin, params)

    monkeypatch.setattr(_agent.Agent, "create", refuse_uring)
    caplog.set_level(logging.WARNING, logger="hicache.nixl")
    _roundtrip({"root": str(tmp_path), "engine": "uring"})
    assert "falling back to engine='aio'" in caplog.text


def test_uring_and_aio_store_the_same_files(tmp_path: Path) -> None:
    _roundtrip({"root": str(tmp_path), "engine": "uring"})
    # a store on the other engine reads what io_uring wrote
    pool = kv_pool(6)
    hashes = [hex_hash("rt-page_first", i) for i in range(6)]
    with controller({"root": str(tmp_path), "engine": "aio"}, pool) as ctl:
        assert ctl.prefetch(hashes, range(6)).pages == 6
        assert all(matches(pool, i, h) for i, h in enumerate(hashes))


# ---------------------------------------------------------------------- path safety
def test_symlinks_below_the_root_are_never_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    pool = kv_pool(4)
    hashes = [hex_hash("link", i) for i in range(4)]
    with controller({"root": str(root)}, pool) as ctl:
        for s in range(256):  # made empty at open: swap every shard for a symlink
            (root / f"{s:02x}").rmdir()
            (root / f"{s:02x}").symlink_to(outside, target_is_directory=True)
        fill(pool, list(range(4)), hashes)
        assert ctl.backup(hashes, range(4)).pages == 0  # the batch fails, nothing is written there
        assert list(outside.iterdir()) == []
    (tmp_path / "root2").mkdir()
    (tmp_path / "root2" / "index.log").symlink_to(outside / "log")
    with pytest.raises(BackendIOError, match=r"index\.log cannot be opened"):
        hc.open_store(StorageConfig(backend="nixl", options={"root": str(tmp_path / "root2")}))
    assert list(outside.iterdir()) == []


def test_segments_of_dead_writers_are_removed_at_open(tmp_path: Path) -> None:
    root = tmp_path / "root"
    hc.open_store(StorageConfig(backend="nixl", options={"root": str(root)})).close()
    host = xxhash.xxh3_64_hexdigest(socket.gethostname().encode())[:8]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / "00" / f"{host}-{dead.pid}-0badf00d-1").write_bytes(b"no record names it")
    (root / "00" / f"{host}-{os.getpid()}-0badf00d-1").write_bytes(b"live writer")
    hc.open_store(StorageConfig(backend="nixl", options={"root": str(root)})).close()
    assert sorted(p.name for p in (root / "00").iterdir()) == [f"{host}-{os.getpid()}-0badf00d-1"]


# -------------------------------------------------------------------- per-page failure
def test_a_failed_transfer_is_reported_per_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _agent.Agent.transfer
    bad: list[int] = []

    def flaky(self: Any, op: str, local: Any, remote: Any, mem: str, keep: Any = None) -> bool:
        if any(a <= bad[0] < a + n for a, n, _ in local):  # the batch, then that component alone
            return False
        return real(self, op, local, remote, mem, keep)

    pool = kv_pool(4)
    hashes = [hex_hash("flaky", i) for i in range(4)]
    with controller({"root": str(tmp_path)}, pool) as ctl:
        fill(pool, list(range(4)), hashes)
        keys = [k for page in ctl.store.page_keys(PoolName.KV, hashes) for k in page]
        views = [v for p in pool.page_views(range(4)) for v in p]
        bad.append(views[2].data_ptr())  # page 1's k
        monkeypatch.setattr(_agent.Agent, "transfer", flaky)
        flags = ctl.store.batch_io_v1(IoOp.SET, keys, views, PoolName.KV)
        monkeypatch.undo()
        assert flags == [True, True, False, True, True, True, True, True]
        assert ctl.store.batch_io_v1(IoOp.EXISTS, keys, None, PoolName.KV) == flags
        for b in pool.buffers():
            b.zero_()
        assert ctl.store.batch_io_v1(IoOp.GET, keys, views, PoolName.KV) == flags
        assert matches(pool, 0, hashes[0]) and matches(pool, 3, hashes[3])


# ------------------------------------------------------------------------- listeners
def _socket_inodes() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


def test_a_posix_store_opens_no_socket(tmp_path: Path) -> None:
    """The NIXL agent runs without its listener thread: nothing listens, nothing connects."""
    before = _socket_inodes()
    pool = kv_pool(2)
    hashes = [hex_hash("sock", i) for i in range(2)]
    with controller({"root": str(tmp_path)}, pool) as ctl:
        fill(pool, [0, 1], hashes)
        assert ctl.backup(hashes, [0, 1]).pages == 2
        assert _socket_inodes() == before


# ------------------------------------------------------------------------ index log
def test_index_log_skips_damage_and_waits_for_an_unfinished_tail() -> None:
    from hicache_nixl import _index as ix

    recs = [ix.pack(ix.PUT, f"seg-{i}", [ix.Entry(f"ns.k{i}", 0, 10, i)]) for i in range(3)]
    damaged = bytearray(recs[1])
    damaged[40] ^= 1
    log = recs[0] + bytes(damaged) + recs[2]
    used, skipped, got = ix.parse(log)
    assert [r.name for r in got] == ["seg-0", "seg-2"]  # the damaged record alone is lost
    assert (used, skipped) == (len(log), len(recs[1]))
    # a record still being appended (or torn by a killed writer) with nothing after it: not consumed
    used, skipped, got = ix.parse(recs[0] + recs[1][:-100])
    assert [r.name for r in got] == ["seg-0"] and (used, skipped) == (len(recs[0]), 0)
    clear = ix.pack(ix.CLEAR, "ns")
    assert [(r.kind, r.name, r.entries) for r in ix.parse(clear)[2]] == [(ix.CLEAR, "ns", [])]
