"""A wrong *type* of page hash, key, host indices or token ids is a TypeError as well as the
specific hicache error (KeyFormatError / BatchShapeError) that documents the argument."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hicache_core as hc


@pytest.fixture
def ctl(tmp_path: Path) -> Iterator[hc.CacheController]:
    cfg = hc.StorageConfig(backend="file", options={"root": str(tmp_path)}, model_name="m")
    with hc.CacheController(cfg, hc.MHAKVPool(8, 4, 2, 1, 8, torch.float16)) as controller:
        yield controller


HASHES = hc.page_hashes(list(range(8)), 4)


def _calls(ctl: hc.CacheController) -> dict[str, tuple[Callable[[], Any], type[hc.HiCacheError]]]:
    idx = torch.arange(2)
    return {
        "int hash (backup)": (lambda: ctl.backup([1, 2], idx), hc.KeyTypeError),
        "bytes hash (prefetch)": (lambda: ctl.prefetch([b"a" * 64, b"b" * 64], idx), hc.KeyTypeError),
        "None hash (query)": (lambda: ctl.query([None]), hc.KeyTypeError),
        "hashes not a sequence": (lambda: ctl.backup(12, idx), hc.BatchTypeError),
        "hashes as a set": (lambda: ctl.backup(set(HASHES), idx), hc.BatchTypeError),
        "float tensor indices": (
            lambda: ctl.backup(HASHES, torch.arange(2, dtype=torch.float32)),
            hc.BatchTypeError,
        ),
        "str indices": (lambda: ctl.backup(HASHES, "ab"), hc.BatchTypeError),
        "None indices": (lambda: ctl.prefetch(HASHES, None), hc.BatchTypeError),
        "str tokens": (lambda: hc.page_hashes("abcd", 4), hc.BatchTypeError),
        "float tokens": (lambda: hc.page_hashes([1.5] * 4, 4), hc.BatchTypeError),
        "str page size": (lambda: hc.page_hashes([1] * 4, "4"), hc.BatchTypeError),
        "int prior hash": (lambda: hc.page_hashes([1] * 4, 4, 7), hc.KeyTypeError),
        "int key": (lambda: hc.check_key(5), hc.KeyTypeError),
        "keys as one str": (lambda: hc.check_keys("abc"), hc.KeyTypeError),
    }


def test_wrong_types_are_type_errors_and_the_specific_error(ctl: hc.CacheController) -> None:
    for what, (call, cls) in _calls(ctl).items():
        with pytest.raises(cls) as info:
            call()
        assert isinstance(info.value, TypeError), what
        assert isinstance(info.value, ValueError), what  # still the documented ValueError subclass
        assert isinstance(info.value, hc.ArgumentTypeError), what
        base = hc.KeyFormatError if cls is hc.KeyTypeError else hc.BatchShapeError
        assert isinstance(info.value, base), what


def test_wrong_values_stay_value_errors_only(ctl: hc.CacheController) -> None:
    for call in (
        lambda: ctl.backup(["../x"], [0]),
        lambda: hc.check_key("a/b"),
        lambda: ctl.backup(HASHES, [0]),  # lengths differ
        lambda: ctl.backup(HASHES, [0, 99]),  # out of range
        lambda: hc.page_hashes([2**32], 1),
        lambda: hc.page_hashes([1], 0),
    ):
        with pytest.raises(ValueError) as info:
            call()
        assert isinstance(info.value, hc.HiCacheError)
        assert not isinstance(info.value, TypeError), info.value
