"""hf3fs against hostile input: a flipped bit in the index log, bad keys at the hook, bad options.

Public names only (``hicache_core``, the backend's ``Options`` and hooks, files on disk), so
this file also runs against older versions of the backend.

* One flipped bit in a record in the middle of the index log ``{prefix}.{rank}.bin.idx`` costs
  that record's page only: every other page is still found, with its exact bytes, on reopen.
* A hostile key sent straight to ``hicache_batch_io_v1`` -- a path separator, ``..``, NUL,
  bytes, or a ``str`` subclass that spells a valid key but behaves otherwise -- gets
  ``KeyFormatError`` and nothing is written.
* Options outside what the backend can honour are refused when the store opens, naming the
  field, instead of being accepted and failing at the first write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf3fs_util import config, pattern

import hicache_core as hc
from hicache_core import CacheController, IoOp, KeyFormatError, MHAKVPool, OptionsError, open_store

NB = 4096
KEYS = [f"ns-a.kv.k.tp0of1.page{i:02d}" for i in range(9)]
VICTIM = 4  # the record in the middle of the log


def _bufs(keys: list[str]) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(pattern(k, NB)), dtype=torch.uint8) for k in keys]


def _read(store: Any, keys: list[str]) -> list[bytes | None]:
    out = [torch.zeros(NB, dtype=torch.uint8) for _ in keys]
    flags = store.batch_io_v1(IoOp.GET, keys, out)
    return [o.numpy().tobytes() if ok else None for o, ok in zip(out, flags)]


def _hook(store: Any) -> Any:
    """The real Hf3fsBackend instance, whose hooks are called directly (no controller, no Store)."""
    return store.backend


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ------------------------------------------------------------------ index log
# Offsets of a bit flip relative to the start of the victim's key in its record: the record ends
# with ``kind | 0 | key length | slot | seq | key`` in every index format so far.
FLIPS = {"key": 12, "seq": -1, "slot": -10, "key-length": -14, "kind": -16}


@pytest.mark.parametrize("where", sorted(FLIPS))
def test_one_flipped_bit_in_a_middle_index_record_costs_that_page_only(tmp_path: Path, where: str) -> None:
    prefix = tmp_path / "h"
    cfg = config(prefix, options={"bytes_per_page": NB})
    store = open_store(cfg)
    for key in KEYS:  # one record per set, in this order
        assert store.batch_io_v1(IoOp.SET, [key], _bufs([key])) == [True]
    store.close()

    idx = Path(f"{prefix}.0.bin.idx")
    raw = bytearray(idx.read_bytes())
    at = raw.index(KEYS[VICTIM].encode()) + FLIPS[where]
    raw[at] ^= 0x10  # one bit, on disk
    idx.write_bytes(bytes(raw))

    store = open_store(cfg)
    expected = [i != VICTIM for i in range(len(KEYS))]
    assert store.batch_io_v1(IoOp.EXISTS, KEYS) == expected, "pages after the damaged record were lost"
    got = _read(store, KEYS)
    assert got == [pattern(k, NB) if ok else None for k, ok in zip(KEYS, expected)]
    # the lost page is an ordinary miss: the next backup stores it again
    assert store.batch_io_v1(IoOp.SET, [KEYS[VICTIM]], _bufs([KEYS[VICTIM]])) == [True]
    assert _read(store, KEYS) == [pattern(k, NB) for k in KEYS]
    store.close()
    store = open_store(cfg)  # and the repaired log replays cleanly
    assert _read(store, KEYS) == [pattern(k, NB) for k in KEYS]
    store.close()


# ------------------------------------------------------------------ keys at the hook
class _Sneaky(str):
    """Spells a valid key, but encodes, splits and hashes like another one."""

    def encode(self, *args: Any, **kwargs: Any) -> bytes:
        return b"../../outside/key"

    def split(self, *args: Any, **kwargs: Any) -> list[str]:
        return ["ns-a", "kv", "k", "all", "zz"]  # claims to be rank-replicated

    def __hash__(self) -> int:
        return hash("ns-a.kv.k.tp0of1.other")


HOSTILE: dict[str, object] = {
    "separator": "ns-a/kv.k.tp0of1.x",
    "backslash": "ns-a\\kv.k.tp0of1.x",
    "parent": "ns-a.kv.k.tp0of1..",
    "dotdot-path": "../../etc/passwd",
    "nul": "ns-a.kv.k.tp0of1.x\0y",
    "empty": "",
    "too-long": "k" * 256,
    "bytes": b"ns-a.kv.k.tp0of1.x",
    "str-subclass": _Sneaky("ns-a.kv.k.tp0of1.sneaky"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_key_straight_to_the_hook_is_refused_and_nothing_is_written(
    tmp_path: Path, name: str
) -> None:
    store = open_store(config(tmp_path / "h", options={"bytes_per_page": NB}))
    backend: Any = store.backend  # the real Hf3fsBackend: its hook, with no controller in front
    keys = [KEYS[0], HOSTILE[name]]
    for op in (IoOp.SET, IoOp.GET, IoOp.EXISTS):
        bufs = None if op is IoOp.EXISTS else _bufs(KEYS[:2])
        with pytest.raises(KeyFormatError):
            backend.hicache_batch_io_v1(op=op, keys=keys, buffers=bufs)
    assert _files(tmp_path) == [], "a batch with a bad key touched the disk"
    store.close()


class _Shifty(list):  # type: ignore[type-arg]
    """Iterates as valid keys, but indexing returns a hostile one."""

    def __getitem__(self, i: Any) -> Any:
        return "../../escaped" if isinstance(i, int) else super().__getitem__(i)


def test_keys_checked_are_the_keys_used(tmp_path: Path) -> None:
    prefix = tmp_path / "h"
    store = open_store(config(prefix, options={"bytes_per_page": NB}))
    keys = _Shifty(KEYS[:2])
    assert _hook(store).hicache_batch_io_v1(op=IoOp.SET, keys=keys, buffers=_bufs(KEYS[:2])) == [True, True]
    assert store.batch_io_v1(IoOp.EXISTS, KEYS[:2]) == [True, True]
    store.close()
    assert b"escaped" not in Path(f"{prefix}.0.bin.idx").read_bytes()
    assert _files(tmp_path) == ["h.0.bin", "h.0.bin.idx", "h.0.bin.lock"]


def test_a_single_string_is_not_a_batch_of_keys(tmp_path: Path) -> None:
    store = open_store(config(tmp_path / "h", options={"bytes_per_page": NB}))
    with pytest.raises(KeyFormatError):
        _hook(store).hicache_batch_io_v1(op=IoOp.EXISTS, keys="abc", buffers=None)
    with pytest.raises(KeyFormatError):
        _hook(store).hicache_clear(namespace="../ns")
    store.close()


# ------------------------------------------------------------------ options
BAD_OPTIONS: dict[str, tuple[str, Any]] = {
    "file_size-past-off_t": ("file_size", 1 << 64),
    "file_size-inf": ("file_size", float("inf")),
    "file_size-nan": ("file_size", float("nan")),
    "file_size-float": ("file_size", 1.5e9),
    "file_size-bool": ("file_size", True),
    "num_slots-past-index": ("num_slots", 1 << 32),
    "num_slots-bool": ("num_slots", True),
    "num_slots-zero": ("num_slots", 0),
    "bytes_per_page-huge": ("bytes_per_page", 1 << 40),
    "bytes_per_page-negative": ("bytes_per_page", -4096),
    "file_path_prefix-nul": ("file_path_prefix", "x\0y"),
    "file_path_prefix-empty": ("file_path_prefix", ""),
    "fsync-string": ("fsync", "yes"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_options_are_refused_at_open_naming_the_field(tmp_path: Path, case: str) -> None:
    field, value = BAD_OPTIONS[case]
    options: dict[str, Any] = {"file_path_prefix": str(tmp_path / "h"), "num_slots": None}
    options[field] = value
    cfg = config(tmp_path / "h", options=options)
    with pytest.raises(OptionsError) as err:
        open_store(cfg)
    assert f"options.{field}" in str(err.value)
    with pytest.raises(OptionsError, match=field):
        CacheController(cfg, MHAKVPool(2, 4, 1, 1, 8))
    assert _files(tmp_path) == []


def test_slot_size_that_does_not_fit_the_file_is_refused_at_open(tmp_path: Path) -> None:
    opts = {"num_slots": None, "file_size": 1 << 17, "bytes_per_page": 1 << 20}
    with pytest.raises(OptionsError, match="file_size=131072 cannot hold one slot"):
        open_store(config(tmp_path / "h", options=opts))
    assert _files(tmp_path) == []


@pytest.mark.parametrize(
    ("prefix", "says"),
    [
        ("$SURELY_UNSET_VAR_FOR_HF3FS_TEST/x", "SURELY_UNSET_VAR_FOR_HF3FS_TEST is not set"),
        ("~no-such-user-h1/x", "no such user"),
    ],
)
def test_unresolvable_prefix_is_refused_not_created(
    prefix: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SURELY_UNSET_VAR_FOR_HF3FS_TEST", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(hc.OptionsError, match="file_path_prefix") as info:
        hc.open_store(hc.StorageConfig(backend="hf3fs", options={"file_path_prefix": prefix}))
    assert says in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no directory named '$VAR' or '~user' was made


# ------------------------------------------------------------------ symlinks planted at its files
@pytest.mark.parametrize("suffix", [".bin", ".bin.idx", ".bin.lock", ".bin.tmp.{pid}", ".bin.idx.tmp.{pid}"])
def test_a_symlink_planted_at_a_store_file_is_never_followed(tmp_path: Path, suffix: str) -> None:
    """The store's files are opened with ``O_NOFOLLOW``: a planted link fails the open, never
    truncating, reading or writing the file it points at (outside the store's directory)."""
    import os

    victim = tmp_path / "outside" / "victim"
    victim.parent.mkdir()
    victim.write_bytes(b"precious" * 512)
    prefix = tmp_path / "store" / "h"
    prefix.parent.mkdir()
    link = Path(f"{prefix}.0{suffix.format(pid=os.getpid())}")
    link.symlink_to(victim)
    store = open_store(config(prefix, options={"bytes_per_page": NB}))
    try:  # the rank's file opens at its first use: refusing it is fine, touching the victim is not
        store.batch_io_v1(IoOp.SET, [KEYS[0]], _bufs([KEYS[0]]))
    except OSError as err:
        assert "symbolic link" in str(err)
    finally:
        store.close()
    assert victim.read_bytes() == b"precious" * 512
    assert link.is_symlink() or not link.exists()
