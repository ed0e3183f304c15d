"""Direct hot-path hook calls (``hicache_core._hookcall``) keep pluggy's semantics."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import pytest

from hicache_core import (
    BackendIOError,
    IoOp,
    MHAKVPool,
    PoolName,
    StorageConfig,
    hookimpl,
    open_store,
    page_hashes,
)
from hicache_core import hookspecs as specs
from hicache_core._hookcall import PluggyCall, PluginManager, hook_call

pytestmark = pytest.mark.usefixtures("memory_backends")


def _cfg() -> StorageConfig:
    return StorageConfig(backend="memory", model_name="hookcall")


class _Keys:
    """A plugin whose page keys win over the default scheme (tryfirst)."""

    @hookimpl(tryfirst=True)
    def hicache_page_keys(self, pool_name: PoolName, page_hashes: Sequence[str]) -> list[tuple[str, ...]]:
        return [(f"custom.{pool_name.value}.k.{h}", f"custom.{pool_name.value}.v.{h}") for h in page_hashes]


class _Wrapper:
    def __init__(self) -> None:
        self.seen: list[str] = []

    @hookimpl(wrapper=True)
    def hicache_batch_io_v1(self, op: IoOp, keys: Sequence[str]) -> Generator[None, Any, Any]:
        self.seen.append(op.value)
        return (yield)


def test_lone_implementation_is_called_directly_with_the_arguments_it_names() -> None:
    pm = PluginManager(specs.PROJECT_NAME)
    pm.add_hookspecs(specs)
    calls: list[tuple[Any, ...]] = []

    class OnlyKeys:
        @hookimpl
        def hicache_batch_io_v1(self, keys: Sequence[str]) -> list[bool]:  # names a subset of the spec
            calls.append(tuple(keys))
            return [True] * len(keys)

    pm.register(OnlyKeys())
    direct = hook_call(pm, "hicache_batch_io_v1", ("op", "keys", "buffers"))
    assert not isinstance(direct, PluggyCall)
    kwargs = {"op": IoOp.EXISTS, "keys": ["a", "b"], "buffers": None}
    assert direct(IoOp.EXISTS, ["a", "b"], None) == pm.hook.hicache_batch_io_v1(**kwargs) == [True, True]
    assert calls == [("a", "b"), ("a", "b")]


def test_implementation_naming_every_argument_in_order_is_itself_the_call() -> None:
    pm = PluginManager(specs.PROJECT_NAME)
    pm.add_hookspecs(specs)

    class Reordered:
        @hookimpl
        def hicache_batch_io_v1(self, keys: Sequence[str], buffers: Any, op: IoOp) -> list[bool]:
            return [op is IoOp.SET and buffers == "b"] * len(keys)

    class InOrder:
        @hookimpl
        def hicache_batch_io_v1(self, op: IoOp, keys: Sequence[str], buffers: Any) -> list[bool]:
            return [True] * len(keys)

    plugin = Reordered()
    pm.register(plugin)
    reordered = hook_call(pm, "hicache_batch_io_v1", ("op", "keys", "buffers"))
    assert reordered(IoOp.SET, ["x"], "b") == pm.hook.hicache_batch_io_v1(
        op=IoOp.SET, keys=["x"], buffers="b"
    )
    assert reordered(IoOp.SET, ["x"], "b") == [True]
    pm.unregister(plugin)
    in_order = InOrder()
    pm.register(in_order)
    assert hook_call(pm, "hicache_batch_io_v1", ("op", "keys", "buffers")) == in_order.hicache_batch_io_v1


def test_none_result_and_exceptions_are_those_of_pluggy() -> None:
    pm = PluginManager(specs.PROJECT_NAME)
    pm.add_hookspecs(specs)

    class Odd:
        @hookimpl
        def hicache_page_keys(self, pool_name: PoolName, page_hashes: Sequence[str]) -> Any:
            if not page_hashes:
                return None
            raise KeyError("boom")

    pm.register(Odd())
    direct = hook_call(pm, "hicache_page_keys", ("pool_name", "page_hashes"))
    assert direct(PoolName.KV, []) is None
    assert pm.hook.hicache_page_keys(pool_name=PoolName.KV, page_hashes=[]) is None
    with pytest.raises(KeyError, match="boom"):
        direct(PoolName.KV, ["x"])


def test_several_implementations_wrappers_or_monitors_go_through_pluggy() -> None:
    pm = PluginManager(specs.PROJECT_NAME)
    pm.add_hookspecs(specs)
    assert isinstance(hook_call(pm, "hicache_page_keys", ("pool_name", "page_hashes")), PluggyCall)
    gen = pm.generation
    pm.register(_Keys())
    assert pm.generation > gen
    assert not isinstance(hook_call(pm, "hicache_page_keys", ("pool_name", "page_hashes")), PluggyCall)
    undo = pm.add_hookcall_monitoring(lambda *a: None, lambda *a: None)
    assert isinstance(hook_call(pm, "hicache_page_keys", ("pool_name", "page_hashes")), PluggyCall)
    undo()
    assert not isinstance(hook_call(pm, "hicache_page_keys", ("pool_name", "page_hashes")), PluggyCall)
    pm.register(_Wrapper())
    through = hook_call(pm, "hicache_batch_io_v1", ("op", "keys", "buffers"))
    assert isinstance(through, PluggyCall)
    assert through(IoOp.EXISTS, ["a"], None) is None  # the wrapper around no implementation


def test_store_follows_plugins_registered_after_opening() -> None:
    """A plugin registered on ``store.pm`` later takes part in the very next call."""
    hashes = page_hashes(list(range(8)), 4)
    with open_store(_cfg()) as store:
        pool = MHAKVPool(2, 4, 1, 1, 8)
        store.register_pool(PoolName.KV, pool)
        default = store.page_keys(PoolName.KV, hashes)
        store.pm.register(_Keys())
        assert store.page_keys(PoolName.KV, hashes) == [
            (f"custom.kv.k.{h}", f"custom.kv.v.{h}") for h in hashes
        ]
        assert default != store.page_keys(PoolName.KV, hashes)
        wrapper = _Wrapper()
        store.pm.register(wrapper)
        keys = [k for ks in store.page_keys(PoolName.KV, hashes) for k in ks]
        assert store.batch_io_v1(IoOp.EXISTS, keys) == [False] * 4
        assert wrapper.seen == ["exists"]
        store.pm.unregister(wrapper)
        store.batch_io_v1(IoOp.EXISTS, keys)
        assert wrapper.seen == ["exists"], "an unregistered wrapper is not called again"


def test_backend_exception_still_becomes_a_typed_error() -> None:
    cfg = StorageConfig(backend="memory", model_name="hookcall", options={"raise_on": ["exists"]})
    with open_store(cfg) as store:
        assert not isinstance(store._hooks["hicache_batch_io_v1"], PluggyCall)  # the direct path
        with pytest.raises(BackendIOError, match="hicache_batch_io_v1 raised"):
            store.batch_io_v1(IoOp.EXISTS, ["a"])
