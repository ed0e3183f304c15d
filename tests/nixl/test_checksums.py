"""The checksums of the POSIX layout: xxh3_64 of each object's memory segments, computed on a
hashing thread beside NIXL's transfers for large batches (``xxhash`` releases the GIL), inline
otherwise. A flipped byte is a miss whichever part of a pipelined read it lands in."""

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


def test_digests_are_xxh3_64_of_the_segments() -> None:
    data = torch.randint(0, 256, (OBJ + 7,), dtype=torch.uint8)
    raw = data.numpy().tobytes()
    segs = [[(data.data_ptr() + 3, OBJ)], [], [(data.data_ptr(), 100), (data.data_ptr() + 500, 4000)]]
    expected = [
        xxhash.xxh3_64_intdigest(raw[3 : 3 + OBJ]),
        xxhash.xxh3_64_intdigest(b""),
        xxhash.xxh3_64_intdigest(raw[:100] + raw[500:4500]),
    ]
    assert _format.digests(segs) == expected


@pytest.mark.parametrize("way", ["thread", "inline"])
def test_flipped_bytes_in_any_read_part_are_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    if way == "inline":  # as a batch under two read parts is hashed
        monkeypatch.setattr(PosixStore, "_hashing", lambda self, nbytes: None)
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
