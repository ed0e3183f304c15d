"""The POSIX layout's index log after a torn append: later records no longer start on a block
boundary, and a torn record may verify against bytes of the record after it. Neither may hide a
record."""

from __future__ import annotations

import pytest

pytest.importorskip("xxhash")

from hicache_nixl._index import BLOCK, CLEAR, PUT, Entry, pack, parse


def _put(seg: str, key: str) -> bytes:
    return pack(PUT, seg, [Entry(key, 0, 4096, 7)])


@pytest.mark.parametrize("torn", [1, 100, 40, BLOCK - 1])
def test_records_after_a_torn_append_are_read(torn: int) -> None:
    first, torn_rec, later = _put("s1", "ns.a"), _put("s2", "ns.b"), _put("s3", "ns.c")
    log = first + torn_rec[:torn] + later + pack(CLEAR, "ns2")
    consumed, skipped, records = parse(log)
    got = [(r.kind, r.name) for r in records]
    assert got == [(PUT, "s1"), (PUT, "s3"), (CLEAR, "ns2")]
    assert consumed == len(log) and skipped == torn


def test_a_torn_tail_is_left_for_later() -> None:
    first = _put("s1", "ns.a")
    consumed, skipped, records = parse(first + _put("s2", "ns.b")[:300])
    assert [r.name for r in records] == ["s1"] and consumed == len(first) and skipped == 0
