"""The checksums of the POSIX layout: computed through ``XXH3_64bits`` of the xxhash wheel's
extension (ctypes, GIL released) on a hashing thread beside NIXL's transfers for large batches,
inline otherwise, and through ``xxhash`` when that symbol is absent. Every way gives the same
digest, and a flipped byte is a miss whichever part of a pipelined read it lands in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash
from hicache_nixl import _format, _posix
from hicache_nixl._agent import Agent
from hicache_nixl._posix import Item, PosixStore

OBJ = 256 << 10
COUNT = 48  # 12 MiB: over the threshold of the hashing thread, read in three parts


def test_native_hash_is_xxh3_64() -> None:
    fn = _format.native_xxh3
    if fn is None:
        pytest.skip("this xxhash wheel exports no XXH3_64bits: the plugin hashes through xxhash")
    data = torch.randint(0, 256, (OBJ + 7,), dtype=torch.uint8)
    raw = data.numpy().tobytes()
    for n in (0, 1, 17, 240, 241, 4096, 16 << 10, OBJ, OBJ + 7):
        assert fn(data.data_ptr(), n) == xxhash.xxh3_64_intdigest(raw[:n]), n
    segs = [[(data.data_ptr() + 3, OBJ)], [], [(data.data_ptr(), 100), (data.data_ptr() + 500, 4000)]]
    expected = [
        xxhash.xxh3_64_intdigest(raw[3 : 3 + OBJ]),
        xxhash.xxh3_64_intdigest(b""),
        xxhash.xxh3_64_intdigest(raw[:100] + raw[500:4500]),
    ]
    assert _format.digests(segs) == expected


def test_digests_without_the_native_symbol(monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.randint(0, 256, (OBJ,), dtype=torch.uint8)
    segs = [[(data.data_ptr(), OBJ)], [(data.data_ptr() + 5, 1000)]]
    monkeypatch.setattr(_format, "native_xxh3", None)
    raw = data.numpy().tobytes()
    assert _format.digests(segs) == [xxhash.xxh3_64_intdigest(raw), xxhash.xxh3_64_intdigest(raw[5:1005])]


@pytest.mark.parametrize("way", ["thread", "inline"])
def test_flipped_bytes_in_any_read_part_are_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    if way == "inline":  # the fallback: no GIL-free hash, so no hashing thread
        monkeypatch.setattr(_format, "native_xxh3", None)
        monkeypatch.setattr(_posix, "native_xxh3", None)
    elif _format.native_xxh3 is None:
        pytest.skip("this xxhash wheel exports no XXH3_64bits: no hashing thread")
    pool = torch.randint(0, 256, (COUNT * OBJ,), dtype=torch.uint8)
    ref = pool.clone()
    base = pool.data_ptr()
    agent = Agent(30.0)
    agent.create("POSIX", {"use_aio": "true", "use_uring": "false"})
    reg = agent.register([(base, COUNT * OBJ, 0, "")], "DRAM")
    store = PosixStore(agent, str(tmp_path), o_direct=False, fsync=False)
    try:
        items = [Item(f"ns.k{i}", [(base + i * OBJ, OBJ)], OBJ) for i in range(COUNT)]
        assert len(_posix._parts(items)) == 3
        assert store.put(items) == [True] * COUNT
        assert (store._hasher is not None) == (way == "thread")
        (segment,) = (p for p in tmp_path.glob("[0-9a-f][0-9a-f]/*"))
        flips = {0: 5, 20: OBJ - 1, COUNT - 1: 1000}  # item -> byte: the first, middle and last part
        with open(segment, "r+b") as f:
            for i, at in flips.items():
                _, off, _, _ = store._map[f"ns.k{i}"]
                f.seek(off + at)
                byte = f.read(1)[0]
                f.seek(off + at)
                f.write(bytes([byte ^ 0x10]))
        pool.zero_()
        got = store.get(items)
        assert got == [i not in flips for i in range(COUNT)]
        assert store.integrity_errors == len(flips)
        for i in range(COUNT):
            if i not in flips:
                assert torch.equal(pool[i * OBJ : (i + 1) * OBJ], ref[i * OBJ : (i + 1) * OBJ]), i
        assert store.exists([f"ns.k{i}" for i in range(COUNT)]) == [i not in flips for i in range(COUNT)]
    finally:
        store.close()
        agent.deregister(reg)
        agent.close()
