"""Groups ``discovery`` and ``contract``: what can be checked without moving pages."""

from __future__ import annotations

import dataclasses
import warnings
from importlib import import_module, metadata

import pytest

from hicache_core import (
    BACKENDS_GROUP,
    Capabilities,
    DraftIo,
    DraftIoMode,
    DraftOffloadDisabledWarning,
    HostPoolGroup,
    OptionsError,
    PoolName,
    backend_names,
    check_key,
    find_backends,
)
from hicache_core.plugin import describe_backend

from ._base import SuiteBase
from ._context import SuiteContext
from ._rules import rule

__all__ = ["ContractTests", "DiscoveryTests"]


class DiscoveryTests(SuiteBase):
    """Group ``discovery``."""

    @rule("R1")
    def test_discovery_entry_point_resolves(self, hc: SuiteContext) -> None:
        """R1: The entry point named ``backend`` is listed and resolves to the backend class."""
        infos = find_backends()
        assert hc.name in infos, f"{hc.name!r} is not listed in group {BACKENDS_GROUP!r}: {sorted(infos)}"
        assert hc.name in backend_names()
        info = infos[hc.name]
        module, _, attr = info.value.partition(":")
        assert attr, f"entry point {info.value!r} must name a class as 'module:Class'"
        obj: object = import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        assert obj is hc.cls, f"entry point {info.value!r} resolves to {obj!r}, not {hc.cls!r}"

    @rule("R1")
    def test_discovery_metadata(self, hc: SuiteContext) -> None:
        """R1: The distribution's metadata and ``hicache backends`` agree with the class."""
        info = find_backends()[hc.name]
        dist = metadata.distribution(info.distribution)
        assert dist.version == info.version
        eps = [ep for ep in dist.entry_points if ep.group == BACKENDS_GROUP and ep.name == hc.name]
        assert [ep.value for ep in eps] == [info.value], f"{info.distribution} declares {eps}"
        row = describe_backend(hc.name)
        assert row["status"] == "ok", row["status"]
        assert row["distribution"] == info.distribution
        assert row["capabilities"] == hc.class_caps.as_dict()

    @rule("R2")
    def test_discovery_open_close(self, hc: SuiteContext) -> None:
        """R2: ``open_store`` builds the class with ``(config, options)``; closing twice is harmless."""
        store = hc.open()
        assert isinstance(store.backend, hc.cls)
        assert store.capabilities == hc.caps
        store.close()
        store.close()
        assert store.closed


class ContractTests(SuiteBase):
    """Group ``contract``."""

    @rule("R3")
    def test_contract_options_forbid_extras(self, hc: SuiteContext) -> None:
        """R3: ``Options`` forbids unknown fields (typed ``OptionsError`` naming backend and field)."""
        model = hc.cls.Options  # type: ignore[attr-defined]
        assert model.model_config.get("extra") == "forbid"
        model()  # every field has a default
        model.model_validate(hc.options)
        bad = "hicache_conformance_no_such_option"
        with pytest.raises(OptionsError) as info:
            hc.open(options={**hc.options, bad: 1})
        assert hc.name in str(info.value) and bad in str(info.value)

    @rule("R4", "R33", "R35")
    def test_contract_capabilities_well_formed(self, hc: SuiteContext) -> None:
        """R4, R33, R35: ``capabilities`` is a valid ``Capabilities`` whose hooks and pools agree."""
        caps = hc.caps
        assert isinstance(caps, Capabilities)
        assert Capabilities(**{f.name: getattr(caps, f.name) for f in dataclasses.fields(caps)}) == caps
        assert PoolName.KV in caps.pools
        for flag, hook in (("v1", "hicache_batch_io_v1"), ("v2", "hicache_batch_io_v2")):
            if getattr(caps, flag):
                assert callable(getattr(hc.cls, hook, None)), (
                    f"capabilities.{flag} is declared but {hook} is missing"
                )
        if caps.zero_copy:
            assert caps.v2, "capabilities.zero_copy needs capabilities.v2"
        if caps.draft_io is DraftIoMode.GENERIC:
            assert caps.v1 and PoolName.DRAFT in caps.pools, hc.declared(
                "draft_io", "generic draft I/O needs capabilities.v1 and 'draft' in capabilities.pools"
            )
        if caps.draft_io is DraftIoMode.ZERO_COPY_V2:
            assert caps.v2 and PoolName.DRAFT in caps.pools, hc.declared(
                "draft_io", "zero_copy_v2 draft I/O needs capabilities.v2 and 'draft' in capabilities.pools"
            )
        for f in dataclasses.fields(caps):
            mine, declared = getattr(caps, f.name), getattr(hc.class_caps, f.name)
            wider = mine > declared if isinstance(mine, (bool, frozenset)) else False
            assert not wider, f"an instance widens capabilities.{f.name} from {declared!r} to {mine!r}"
        store = hc.open()
        impls = store.pm.hook.hicache_register_pool.get_hookimpls()
        assert any(impl.plugin is store.backend for impl in impls), "hicache_register_pool is not implemented"

    @rule("R34", "R35")
    def test_contract_draft_io_consistent(self, hc: SuiteContext) -> None:
        """R34, R35: Under a default config the draft hook returns the declared ``draft_io``; split heads never get zero-copy."""
        declared = hc.caps.draft_io
        got = hc.open().draft_io()
        assert isinstance(got, DraftIo)
        assert got.mode is declared, hc.declared(
            "draft_io", f"hicache_draft_io_capability() returns {got.mode.value!r} under a default config"
        )
        if got.mode is DraftIoMode.UNSUPPORTED:
            assert got.reason.strip(), "an 'unsupported' DraftIo must say why (reason)"
        split = hc.open(should_split_heads=True).draft_io()
        assert isinstance(split, DraftIo)
        assert split.mode is not DraftIoMode.ZERO_COPY_V2, (
            "should_split_heads=True must turn zero-copy v2 draft off"
        )
        pools = HostPoolGroup(self.make_kv_pool("mha", 2), {PoolName.DRAFT: self.make_draft_pool(2)})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctl = hc.controller(pools)
        disabled = [w for w in caught if issubclass(w.category, DraftOffloadDisabledWarning)]
        if declared is DraftIoMode.UNSUPPORTED:
            assert not ctl.draft_enabled and len(disabled) == 1
            assert hc.name in str(disabled[0].message)
        else:
            assert ctl.draft_enabled, hc.declared(
                "draft_io", f"the controller disabled draft offload: {disabled}"
            )

    @rule("R21")
    def test_contract_page_keys_safe(self, hc: SuiteContext) -> None:
        """R21: Component keys: one tuple per page, one key per component, file-name safe, all distinct."""
        store = hc.open()
        pools = {
            PoolName.KV: self.make_kv_pool("mha", 4),
            PoolName.MAMBA: self.make_mamba_pool(4),
            PoolName.INDEXER: self.make_indexer_pool(4),
            PoolName.DRAFT: self.make_draft_pool(4),
        }
        hashes = self.make_page_hashes(5)
        seen: set[str] = set()
        for name, pool in pools.items():
            if name not in hc.caps.pools:
                continue
            store.register_pool(name, pool)
            assert len(store.page_keys(name, [])) == 0
            keys = store.page_keys(name, hashes)
            assert len(keys) == len(hashes)
            for page in keys:
                assert len(page) == len(pool.components), f"{name.value}: {page} vs {pool.components}"
                for key in page:
                    check_key(key)
                    assert key not in seen, f"key {key!r} is produced twice"
                    seen.add(key)
