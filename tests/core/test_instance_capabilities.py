"""``capabilities.set_skips_existing`` and per-instance narrowing of capabilities."""

from __future__ import annotations

import pytest

from hicache_core import (
    BackendContractError,
    CacheController,
    Capabilities,
    MHAKVPool,
    StorageConfig,
    open_store,
    page_hashes,
)


def _cfg(backend: str, **options: object) -> StorageConfig:
    return StorageConfig(backend=backend, options=options, model_name="caps")


def _exists_calls(ctl: CacheController) -> int:
    return sum(1 for _, op, _ in ctl.store.backend.calls if op.endswith("exists"))


def test_default_is_false_and_listed() -> None:
    caps = Capabilities()
    assert caps.set_skips_existing is False
    assert caps.as_dict()["set_skips_existing"] is False


@pytest.mark.usefixtures("memory_backends")
def test_backup_without_existence_pass_keeps_stored_pages() -> None:
    pool = MHAKVPool(8, 4, 2, 2, 8)
    hashes = page_hashes(list(range(32)), 4)
    with CacheController(_cfg("memory-skip"), pool) as ctl:
        assert ctl.store.capabilities.set_skips_existing
        for b in pool.buffers():
            b.fill_(1)
        first = ctl.backup(hashes[:4], range(4))
        for b in pool.buffers():
            b.fill_(2)
        again = ctl.backup(hashes, range(8))
        assert first.ok and again.ok and again.pages == 8
        assert again.skipped == 0  # the backend skipped the stored pages itself: not counted
        assert _exists_calls(ctl) == 0, "no existence pass before SET"
        for b in pool.buffers():
            b.zero_()
        assert ctl.prefetch(hashes, range(8)).pages == 8
        k = pool.buffers()[0]
        assert bool((k[:4] == 1).all()) and bool((k[4:] == 2).all())


@pytest.mark.usefixtures("memory_backends")
def test_instance_may_narrow_the_capability() -> None:
    pool = MHAKVPool(4, 4, 2, 2, 8)
    hashes = page_hashes(list(range(16)), 4)
    with CacheController(_cfg("memory-skip", overwrite=True), pool) as ctl:
        assert type(ctl.store.backend).capabilities.set_skips_existing
        assert not ctl.store.capabilities.set_skips_existing
        ctl.backup(hashes, range(4))
        again = ctl.backup(hashes, range(4))
        assert again.skipped == 4 and _exists_calls(ctl) == 2


@pytest.mark.usefixtures("memory_backends")
def test_instance_may_not_widen_capabilities() -> None:
    with pytest.raises(BackendContractError, match=r"only narrow .* adds \['v2'\]"):
        open_store(_cfg("memory-widen"))
