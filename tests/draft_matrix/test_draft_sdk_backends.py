"""Draft resolution for eic / simm, which cannot be opened without their vendor SDKs.

What is exercised, honestly:

* the REAL classes: their declared ``capabilities.draft_io`` and their ``hicache_draft_io_capability``
  hook (called on an instance built without running the refusing constructor), and that opening
  them by name is refused;
* the controller's decision: each real class is subclassed in a throwaway distribution that only
  reports itself available and records pool registrations. Its draft hook, capabilities and
  refusing I/O hooks are inherited unchanged, and no I/O is attempted. Attaching a target KV pool
  plus a draft pool must disable draft with ONE warning that names the backend and quotes the
  real class's reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from draft_util import VARIANTS, make_config, make_group
from hicache_hf3fs_stub.vendor import EicBackend, SimmBackend, VendorSdkBackend

from hicache_core import (
    BackendUnavailableError,
    CacheController,
    DraftIoMode,
    DraftOffloadDisabledWarning,
    PoolName,
    StorageConfig,
    open_store,
)
from tests.support.distinfo import installed_dist

CLASSES: dict[str, type[VendorSdkBackend]] = {"eic": EicBackend, "simm": SimmBackend}

SDKFREE = '''
from hicache_core import hookimpl
from hicache_hf3fs_stub.vendor import EicBackend, SimmBackend


class _Attachable:
    """Reports itself available and records pools; everything else is the real class."""

    @classmethod
    def availability(cls):
        return None

    def __init__(self, config, options):
        self.registered = []

    @hookimpl
    def hicache_register_pool(self, pool_name, pool):
        self.registered.append(pool_name)


class SdkFreeEic(_Attachable, EicBackend):
    pass


class SdkFreeSimm(_Attachable, SimmBackend):
    pass
'''


@pytest.fixture(scope="module")
def sdkfree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    names = {name: f"sdkfree-{name}" for name in CLASSES}
    eps = {
        names[n]: f"sdkfree_backends:SdkFree{cls.__name__.removesuffix('Backend')}"
        for n, cls in CLASSES.items()
    }
    with installed_dist(
        tmp_path_factory.mktemp("sdkfree"),
        "hicache-test-sdkfree",
        {"hicache.backends": eps},
        {"sdkfree_backends": SDKFREE},
    ):
        yield names


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_declared_draft_capability_is_unsupported(name: str) -> None:
    cls = CLASSES[name]
    assert cls.capabilities.draft_io is DraftIoMode.UNSUPPORTED
    hook = object.__new__(cls).hicache_draft_io_capability()  # the refusing __init__ is skipped
    assert hook.mode is DraftIoMode.UNSUPPORTED
    assert name in hook.reason and "draft" in hook.reason
    with pytest.raises(BackendUnavailableError, match="needs the vendor SDK"):
        open_store(StorageConfig(backend=name))


@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize(("variant", "split"), VARIANTS)
def test_controller_disables_draft_with_one_warning(
    sdkfree: dict[str, str], tmp_path: Path, name: str, variant: str, split: bool
) -> None:
    real = CLASSES[name]
    cfg = make_config(sdkfree[name], {}, variant, split)
    group = make_group(variant, allocate=True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ctl = CacheController(cfg, group)
    with ctl:
        assert type(ctl.store.backend).__mro__[2] is real
        assert not ctl.draft_enabled and ctl.draft_io.mode is DraftIoMode.UNSUPPORTED
        assert ctl.store.backend.registered == [PoolName.KV]  # the draft pool is never registered
        msgs = [str(w.message) for w in rec if issubclass(w.category, DraftOffloadDisabledWarning)]
        assert len(msgs) == 1, msgs
        assert f"backend {sdkfree[name]!r}" in msgs[0] and real.draft_reason() in msgs[0]
