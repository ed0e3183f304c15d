"""Test a hicache backend through SGLang's storage path, without an SGLang server or a GPU.

One import gives SGLang host pools, the adapter created the way SGLang creates it, and a
byte-exact round trip::

    from hicache_sglang.testing import create_adapter, mha_host_pool, roundtrip

    def test_example_through_sglang(tmp_path):
        kv = mha_host_pool(num_pages=16)
        adapter = create_adapter("example", {"root": str(tmp_path)}, kv)
        try:
            roundtrip(adapter, kv, pages=4)  # set, exists, get into other slots, every byte compared
        finally:
            adapter.clear()
            adapter.close()

**The pools.** SGLang's own host-pool classes (``sglang.srt.mem_cache.pool_host``) cannot be
imported without ``transformers``, CUDA kernels and a device pool to size them from. So the pools
here are small objects carrying the attributes SGLang's storage path reads, while every method a
storage backend calls is SGLang's own: its source is read from the installed ``sglang`` package
(``init_kv_buffer``, ``get_page_buffer_meta``, ``get_data_page``, ``get_dummy_flat_data_page``,
``set_from_flat_data_page``, ``get_hybrid_pool_buffer``, ...) and compiled as methods of these
classes. Buffers, page geometry and the zero-copy ``(ptr, size)`` metadata are therefore exactly
SGLang's, for every layout (``page_first``, ``layer_first``, ``page_first_direct``, ``page_head``).

**The adapter** is made by ``StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig,
host_pool)`` then ``register_mem_pool_host`` (and ``register_mem_host_pool_v2`` per pool for
hybrid models), as SGLang's cache controllers do. Needs ``sglang`` installed (the ``hicache-sglang``
``test`` extra lists the light dependencies of its storage modules; ``setup-dev.sh`` installs
``sglang`` itself without its CUDA pins) and numpy.
"""

from __future__ import annotations
import __future__

import ast
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_core import page_hashes

__all__ = [
    "ADAPTER_LOADER",
    "MHAHost",
    "MLAHost",
    "MambaHost",
    "buffers_of",
    "chained_hashes",
    "create_adapter",
    "fill_random",
    "mamba_host_pool",
    "mha_host_pool",
    "mla_host_pool",
    "page_bytes",
    "roundtrip",
    "sglang_config",
    "token_indices",
]

ADAPTER_LOADER = {"backend_name": "hicache", "module_path": "hicache_sglang", "class_name": "HiCacheAdapter"}
"""The keys of SGLang's ``--hicache-storage-backend-extra-config`` that load this adapter."""

_POOL_HOST = "srt/mem_cache/pool_host"


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "hicache_sglang.testing needs the sglang package; install it as integrations/sglang/"
            "setup-dev.sh does (`pip install --no-deps sglang==0.5.23` plus hicache-sglang's `test` extra)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _alloc(
    dims: Sequence[int],
    *,
    dtype: torch.dtype,
    device: Any,
    pin_memory: bool = False,
    allocator: Any = None,
    registration_granularity_bytes: Any = None,
) -> torch.Tensor:
    """CPU stand-in for SGLang's ``ALLOC_MEMORY_FUNCS["cpu"]`` (random bytes, not zeros)."""
    n = int(np.prod(dims)) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8).view(dtype).view(*dims)


_NAMESPACE: dict[str, Any] = {"torch": torch, "np": np, "ALLOC_MEMORY_FUNCS": {"cpu": _alloc}}


def _methods(relpath: str, class_name: str, names: Sequence[str]) -> dict[str, Any]:
    """Compile methods ``names`` of SGLang's ``class_name`` from its source file ``relpath``."""
    path = _sglang_root() / relpath
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise ImportError(f"SGLang has no class {class_name} in {relpath}; this helper targets SGLang 0.5.23")
    out: dict[str, Any] = {}
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef) or node.name not in names:
            continue
        decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
        node.decorator_list = []
        ns = dict(_NAMESPACE)
        module = ast.Module(body=[node], type_ignores=[])
        flags = __future__.annotations.compiler_flag
        exec(compile(module, str(path), "exec", flags=flags, dont_inherit=True), ns)
        fn = ns[node.name]
        out[node.name] = (
            staticmethod(fn)
            if "staticmethod" in decorators
            else property(fn)
            if "property" in decorators
            else fn
        )
    missing = sorted(set(names) - set(out))
    if missing:
        raise ImportError(
            f"SGLang's {class_name} ({relpath}) has no methods {missing}; this helper targets 0.5.23"
        )
    return out


def _with_methods(cls: type, relpath: str, class_name: str, names: Sequence[str]) -> None:
    for name, fn in _methods(relpath, class_name, names).items():
        setattr(cls, name, fn)


_KV_METHODS = (
    "init_kv_buffer",
    "get_page_buffer_meta",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
)


class _HostBase:
    """The attributes of SGLang's ``HostKVCache.__init__`` that its storage path reads."""

    dcp_size = 1
    dcp_rank = 0
    storage_format_tag = None
    _compiled = False
    _sources: tuple[str, str, tuple[str, ...]] = ("", "", ())

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not cls._compiled:  # SGLang's source is read on first use, not on import
            relpath, class_name, names = cls._sources
            _with_methods(cls, relpath, class_name, names)
            cls._compiled = True
        return super().__new__(cls)

    def _init_common(self, num_pages: int, page_size: int, layout: str, dtype: torch.dtype) -> None:
        self.page_size = page_size
        self.page_num = num_pages
        self.size = num_pages * page_size
        self.layout = layout
        self.dtype = dtype
        self.device = "cpu"
        self.pin_memory = False
        self.allocator = None
        self._transfer_device = torch.device("cpu")

    @property
    def logical_size(self) -> int:
        return self.size * self.dcp_size

    @property
    def logical_page_size(self) -> int:
        return self.page_size * self.dcp_size


class MHAHost(_HostBase):
    """SGLang's ``MHATokenToKVPoolHost``: K and V, ``kv_buffer`` shaped by its ``init_kv_buffer``."""

    _sources = (f"{_POOL_HOST}/mha.py", "MHATokenToKVPoolHost", (*_KV_METHODS, "get_hybrid_pool_buffer"))

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        layout: str = "page_first",
    ) -> None:
        self._init_common(num_pages, page_size, layout, dtype)
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = (
            layer_num,
            head_num,
            head_dim,
            head_dim,
        )
        self.kv_buffer = self.init_kv_buffer()  # type: ignore[attr-defined]

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]  # type: ignore[no-any-return]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]  # type: ignore[no-any-return]


class MLAHost(_HostBase):
    """SGLang's ``MLATokenToKVPoolHost``: one latent KV component per page, rank-replicated."""

    _sources = (f"{_POOL_HOST}/mla.py", "MLATokenToKVPoolHost", (*_KV_METHODS, "_storage_page_index"))

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        layer_num: int,
        kv_cache_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        layout: str = "page_first",
    ) -> None:
        self._init_common(num_pages, page_size, layout, dtype)
        self.layer_num, self.kv_cache_dim = layer_num, kv_cache_dim
        self.kv_buffer = self.init_kv_buffer()  # type: ignore[attr-defined]


class MambaHost(_HostBase):
    """SGLang's ``MambaPoolHost``: page size 1, a ``temporal`` buffer plus ``conv_i`` buffers per slot."""

    slot_state_device_tensors: tuple[Any, ...] = ()
    _sources = (
        f"{_POOL_HOST}/mamba.py",
        "MambaPoolHost",
        (
            *_KV_METHODS,
            "get_hybrid_pool_buffer",
            "_iter_page_tensors",
            "_flatten_tensor_bytes",
            "get_size_per_token",
        ),
    )

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        temporal_shape: Sequence[int] = (4, 8),
        conv_shapes: Sequence[Sequence[int]] = ((6, 3), (2, 5)),
        temporal_dtype: torch.dtype = torch.float32,
        conv_dtype: torch.dtype = torch.bfloat16,
        layout: str = "page_first",
    ) -> None:
        self._init_common(num_slots, 1, layout, conv_dtype)
        self._buffer_device = torch.device("cpu")
        self.num_mamba_layers = num_layers
        self.temporal_state_shape = tuple(temporal_shape)
        self.conv_state_shapes = [tuple(s) for s in conv_shapes]
        self.temporal_state_elem_size = int(np.prod(self.temporal_state_shape))
        self.conv_state_elem_sizes = [int(np.prod(s)) for s in self.conv_state_shapes]
        self.temporal_dtype, self.conv_dtype = temporal_dtype, conv_dtype
        self.size_per_token = self.get_size_per_token()  # type: ignore[attr-defined]
        self.kv_buffer = self.init_kv_buffer()  # type: ignore[attr-defined]


def mha_host_pool(
    num_pages: int = 16,
    page_size: int = 4,
    layer_num: int = 2,
    head_num: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "page_first",
) -> MHAHost:
    """A small SGLang MHA host pool (K and V per page)."""
    return MHAHost(num_pages, page_size, layer_num, head_num, head_dim, dtype, layout)


def mla_host_pool(
    num_pages: int = 16,
    page_size: int = 4,
    layer_num: int = 2,
    kv_cache_dim: int = 24,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "page_first",
) -> MLAHost:
    """A small SGLang MLA host pool (one latent component per page; pass ``is_mla=True`` to
    :func:`create_adapter`)."""
    return MLAHost(num_pages, page_size, layer_num, kv_cache_dim, dtype, layout)


def mamba_host_pool(num_slots: int = 8, num_layers: int = 2, layout: str = "page_first") -> MambaHost:
    """A small SGLang Mamba state pool, for ``create_adapter(..., pools={PoolName.MAMBA: pool})``."""
    return MambaHost(num_slots, num_layers, layout=layout)


def sglang_config(
    extra_config: Mapping[str, Any],
    *,
    is_mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str | None = None,
    page_first: bool = True,
    metrics: bool = False,
) -> Any:
    """SGLang's ``HiCacheStorageConfig``, filled as ``HiCacheController._generate_storage_config`` does."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=dict(extra_config),
    )


def create_adapter(
    backend: str,
    options: Mapping[str, Any],
    kv_pool: Any,
    *,
    pools: Mapping[Any, Any] | None = None,
    model: str | None = None,
    is_mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    metrics: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """The ``hicache_sglang.HiCacheAdapter`` for hicache ``backend`` and ``options``, created and
    attached exactly as SGLang does it (``StorageBackendFactory``, ``dynamic`` backend).

    ``pools`` maps SGLang ``PoolName``s (``sglang.srt.mem_cache.hicache_storage.PoolName``) to
    extra host pools (Mamba, indexer, draft): they are registered through the v2 interface as
    SGLang's hybrid controller does. ``model`` defaults to a fresh name (so a fresh key
    namespace); ``extra`` adds keys to the extra config. Clear and close the adapter when done
    (``adapter.clear()``, ``adapter.close()``).
    """
    import uuid

    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra_config = {
        **ADAPTER_LOADER,
        "interface_v1": 1,
        "hicache_backend": backend,
        "hicache_options": dict(options),
        **(extra or {}),
    }
    cfg = sglang_config(
        extra_config,
        is_mla=is_mla,
        tp_rank=tp_rank,
        tp_size=tp_size,
        model=model or f"hicache-sglang-testing/{uuid.uuid4().hex[:12]}",
        page_first=kv_pool.layout == "page_first",
        metrics=metrics,
    )
    adapter = StorageBackendFactory.create_backend("dynamic", cfg, kv_pool)
    adapter.register_mem_pool_host(kv_pool)
    if pools:
        adapter.register_mem_host_pool_v2(kv_pool, PoolName.KV)
        for name, pool in pools.items():
            adapter.register_mem_host_pool_v2(pool, name)
        adapter.on_host_pools_registered()
    return adapter


def buffers_of(pool: Any) -> list[torch.Tensor]:
    """Every host buffer of an SGLang pool."""
    getter: Callable[[], Sequence[torch.Tensor]] | None = getattr(pool, "get_hybrid_pool_buffer", None)
    if getter is not None:
        return [t for t in getter() if t.numel()]
    return [pool.kv_buffer]


def fill_random(pool: Any, seed: int) -> None:
    """Fill every host buffer of ``pool`` with reproducible random bytes."""
    g = torch.Generator().manual_seed(seed)
    for t in buffers_of(pool):
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))


def page_bytes(pool: Any, page: int) -> bytes:
    """The bytes of host page ``page`` in SGLang's flat-page format (its ``get_data_page``)."""
    data = pool.get_data_page(page * pool.page_size, flat=True)
    return bytes(data.contiguous().view(torch.uint8).numpy().tobytes())


def token_indices(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """SGLang host indices: the token indices of each page, ``len(pages) * page_size`` of them."""
    if not pages:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(torch.int64)


def chained_hashes(n: int, page_size: int, seed: int = 0) -> list[str]:
    """``n`` chained page hashes, byte-identical to SGLang's ``get_hash_str`` of the same tokens."""
    tokens = [(seed * 7919 + i * 31) % 50000 for i in range(n * page_size)]
    return list(page_hashes(tokens, page_size))


def roundtrip(adapter: Any, kv_pool: Any, pages: int = 4, seed: int = 0) -> None:
    """Back ``pages`` pages up through SGLang's v1 page path, read them into other host slots and
    compare every byte; raises ``AssertionError`` naming the step that failed.

    Needs ``kv_pool.page_num >= 2 * pages``. Fills the pool with random bytes first.
    """
    if kv_pool.page_num < 2 * pages:
        raise ValueError(f"roundtrip needs a pool of at least {2 * pages} pages, got {kv_pool.page_num}")
    fill_random(kv_pool, seed)
    keys = chained_hashes(pages, kv_pool.page_size, seed)
    src, dst = list(range(pages)), list(range(pages, 2 * pages))
    want = [page_bytes(kv_pool, p) for p in src]
    found = adapter.batch_exists(keys)
    assert found == 0, f"batch_exists found {found} of {pages} pages before any set (fresh keys)"
    stored = adapter.batch_set_v1(keys, token_indices(src, kv_pool.page_size))
    assert stored == [True] * pages, f"batch_set_v1 returned {stored}"
    found = adapter.batch_exists(keys)
    assert found == pages, f"batch_exists found {found} of {pages} pages after the set"
    read = adapter.batch_get_v1(keys, token_indices(dst, kv_pool.page_size))
    assert read == [True] * pages, f"batch_get_v1 returned {read}"
    got = [page_bytes(kv_pool, p) for p in dst]
    bad = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not bad, f"pages {bad} read back with other bytes than were stored"
