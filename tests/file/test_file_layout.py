"""Sharded layout, no directory scans on the I/O path, hostile keys, namespace-scoped clear."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch
from file_helpers import config, files_under, fill, temp_files

from hicache_core import (
    CacheController,
    IoOp,
    KeyFormatError,
    MHAKVPool,
    MLAKVPool,
    PoolName,
    open_store,
    page_hashes,
)


def test_sharded_tree(tmp_path: Path) -> None:
    kv = MHAKVPool(40, 2, 2, 1, 8)
    fill(kv, 1)
    hashes = page_hashes(list(range(80)), 2)
    with CacheController(config(tmp_path), kv) as ctl:
        assert ctl.backup(hashes, range(40)).ok
        namespace = ctl.store.keys.scheme.namespace
    files = files_under(tmp_path)
    assert len(files) == 80
    for rel in files:
        ns, shard, key = rel.split(os.sep)
        assert ns == namespace == key.split(".")[0]
        assert shard == key[-1:]
    leaf_dirs = {os.path.dirname(f) for f in files}
    # K and V of a page share the page hash, hence a leaf directory; 40 pages over 16 shards
    assert 10 < len(leaf_dirs) <= 16, "pages must spread over the 16 shard directories"
    assert not temp_files(tmp_path)


def test_payload_starts_on_a_64_byte_boundary(tmp_path: Path) -> None:
    """Format 2: header + key + zero padding, so the kernel copies the payload cache-line aligned."""
    from hicache_file import _format as fmt

    assert fmt.FORMAT_VERSION == 2
    for klen in (0, 1, 39, 40, 41, 103, 104, 105, 1000):
        size = fmt.header_size(klen)
        assert size % 64 == 0 and 24 + klen <= size < 24 + klen + 64
    kv = MHAKVPool(4, 2, 2, 1, 8)
    fill(kv, 1)
    hashes = page_hashes(list(range(8)), 2)
    with CacheController(config(tmp_path), kv) as ctl:
        assert ctl.backup(hashes, range(4)).ok
        for ks in ctl.store.page_keys("kv", hashes):
            for key, view in zip(ks, [b[0] for b in kv.buffers()]):
                raw = Path(ctl.store.backend.path_of(key)).read_bytes()
                start = fmt.header_size(len(key))
                assert raw[4] == 2 and raw[24 : 24 + len(key)] == key.encode()
                assert raw[24 + len(key) : start] == bytes(start - 24 - len(key))
                assert len(raw) == start + view.numel() * view.element_size()


def test_io_never_scans_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = MHAKVPool(16, 2, 2, 1, 8)
    fill(kv, 2)
    hashes = page_hashes(list(range(32)), 2)

    def forbidden(*args: object, **kw: object) -> None:
        raise AssertionError(f"directory scan on the I/O path: {args}")

    with CacheController(config(tmp_path), kv) as ctl:
        for name in ("scandir", "listdir", "walk"):
            monkeypatch.setattr(os, name, forbidden)
        monkeypatch.setattr(glob, "glob", forbidden)
        monkeypatch.setattr(glob, "iglob", forbidden)
        assert ctl.query(hashes).pages == 0
        assert ctl.backup(hashes, range(16)).ok
        assert ctl.query(hashes).pages == 16
        assert ctl.prefetch(hashes, range(16)).pages == 16
        again = ctl.backup(hashes, range(16))  # every page stored: each file is skipped
        assert again.ok and ctl.store.backend.stats.skipped_writes == 32
        monkeypatch.undo()


HOSTILE = [
    "../escape",
    "ns/../../escape",
    "/abs/path",
    "a/b",
    "a\\b",
    "..",
    ".",
    ".hidden",
    "a..b",
    "nul\0byte",
    "",
    "x" * 300,
    "space key",
    "ns.k\n",
    "ünïcode",
]


@pytest.mark.parametrize("op", [IoOp.EXISTS, IoOp.GET, IoOp.SET])
def test_hostile_keys_are_rejected(tmp_path: Path, op: IoOp) -> None:
    root = tmp_path / "root"
    before = sorted(p for p in tmp_path.rglob("*") if root not in p.parents and p != root)
    with open_store(config(root)) as store:
        for key in HOSTILE:
            buffers = None if op is IoOp.EXISTS else [torch.ones(8, dtype=torch.uint8)]
            with pytest.raises(KeyFormatError):
                store.batch_io_v1(op, [key], buffers)
            # one bad key fails the call before anything is written for the good ones
            with pytest.raises(KeyFormatError):
                store.batch_io_v1(op, ["ok.key", key], None if buffers is None else buffers * 2)
    after = sorted(p for p in tmp_path.rglob("*") if root not in p.parents and p != root)
    assert before == after, "nothing may be created outside root"
    assert files_under(root) == []
    with open_store(config(root)) as store:
        for bad in (123, None, b"bytes.key", ["a", "b"]):
            with pytest.raises(KeyFormatError):
                store.batch_io_v1(IoOp.EXISTS, [bad])  # type: ignore[list-item]
        with pytest.raises(KeyFormatError):
            store.backend.hicache_clear(namespace="../x")
        assert store.backend._path_cache == {}, "rejected keys are never memoised"


def test_short_and_dotted_keys_stay_inside_root(tmp_path: Path) -> None:
    keys = ["a", "ab", "abc", "a.b", "x.y.z-_", "nodot-key", "a.bc", "Z9", "ns.", "ns.x."]
    with open_store(config(tmp_path, options={"max_bytes": "1MiB"})) as store:
        bufs = [torch.full((16,), i, dtype=torch.uint8) for i in range(len(keys))]
        assert store.batch_io_v1(IoOp.SET, keys, bufs) == [True] * len(keys)
        outs = [torch.zeros(16, dtype=torch.uint8) for _ in keys]
        assert store.batch_io_v1(IoOp.GET, keys, outs) == [True] * len(keys)
        assert all(torch.equal(a, b) for a, b in zip(bufs, outs))
        for k in keys:
            path = os.path.realpath(store.backend.path_of(k))
            assert path.startswith(os.path.realpath(tmp_path) + os.sep)
            assert os.path.basename(path) == k and os.path.exists(path)
            # always <root>/<namespace>/<shard>/<key>: a key ending in "." gets shard "_", not "."
            assert os.path.relpath(path, os.path.realpath(tmp_path)).count(os.sep) == 2
    assert len(files_under(tmp_path)) == len(keys)
    with open_store(config(tmp_path, options={"max_bytes": "1MiB"})) as store:
        assert store.backend.index is not None and len(store.backend.index) == len(keys), (
            "rescan finds every page"
        )


def test_clear_only_touches_its_namespace(tmp_path: Path) -> None:
    hashes = page_hashes(list(range(24)), 4)
    pools = {}
    for model in ("model-a", "model-b"):
        kv = MHAKVPool(6, 4, 2, 1, 8)
        fill(kv, 3)
        pools[model] = kv
        with CacheController(config(tmp_path, model_name=model), kv) as ctl:
            assert ctl.backup(hashes, range(6)).ok
    other_dtype = MHAKVPool(6, 4, 2, 1, 8)
    fill(other_dtype, 4)
    with CacheController(config(tmp_path, model_name="model-a", kv_dtype="fp8_e4m3"), other_dtype) as ctl:
        assert ctl.backup(hashes, range(6)).ok
    assert len(files_under(tmp_path)) == 36
    with CacheController(config(tmp_path, model_name="model-a"), pools["model-a"]) as ctl:
        assert ctl.clear() == 12
        assert ctl.query(hashes).pages == 0
        assert ctl.clear() == 0
        namespace = ctl.store.keys.scheme.namespace
    assert not os.path.exists(tmp_path / namespace), "the emptied namespace directory is removed"
    for cfg in (
        config(tmp_path, model_name="model-b"),
        config(tmp_path, model_name="model-a", kv_dtype="fp8_e4m3"),
    ):
        with CacheController(cfg, MHAKVPool(6, 4, 2, 1, 8)) as ctl:
            assert ctl.query(hashes).pages == 6
    assert len(files_under(tmp_path)) == 24


def test_clear_with_a_dotted_prefix(tmp_path: Path) -> None:
    hashes = page_hashes(list(range(16)), 4)
    kv = MLAKVPool(4, 4, 2, 16)
    draft = MLAKVPool(4, 4, 1, 16)
    from hicache_core import HostPoolGroup

    with CacheController(
        config(tmp_path, is_mla_model=True), HostPoolGroup(kv, {PoolName.DRAFT: draft})
    ) as ctl:
        assert ctl.backup(hashes, range(4)).ok
        ns = ctl.store.keys.scheme.namespace
        assert ctl.store.backend.hicache_clear(namespace=f"{ns}.draft") == 4
        assert ctl.query(hashes).pages == 4  # target KV untouched
        assert len(files_under(tmp_path)) == 4


def test_header_parts_assemble_the_header() -> None:
    from hicache_file import _format as fmt

    for key in (b"", b"k", b"ns.kv.k.tp0of1." + b"a" * 64, b"x" * 300):
        for size in (0, 1, 16384, 1 << 33):
            fixed, pad = fmt.header_parts(len(key), size)
            assert fixed + key + pad == fmt.encode_header(key, size, 0)
