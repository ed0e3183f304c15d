"""SGLang host pools for the adapter tests, running SGLang 0.5.23's OWN storage-path code.

``sglang.srt.mem_cache.pool_host`` cannot be imported on this CPU-only machine (it pulls in
``transformers`` and a CUDA ``torchvision``), and its pools are built from device-pool buffer
infos. So these classes are minimal host-pool objects that carry exactly the attributes
SGLang's storage path reads, while the METHODS that storage backends call are SGLang's own:
their source is taken from the installed ``sglang`` package with :mod:`ast` and compiled as
methods of these classes. That covers ``init_kv_buffer`` (buffer shapes per layout),
``get_page_buffer_meta`` (the zero-copy contract: MHA two entries per page, MLA one, Mamba one per
buffer), ``get_data_page`` / ``get_dummy_flat_data_page`` / ``set_from_flat_data_page`` (the
flat-page copy path ``HiCacheFile`` and SGLang's generic page path use) and
``get_hybrid_pool_buffer``. If SGLang changes them, these pools change with it.

``SGLangMockHostKVCache`` is the mock from SGLang's own MooncakeStore batch test
(``storage/mooncake_store/test_mooncake_store.py``: K and V interleaved in one flat buffer,
page size 1), loaded the same way.
"""

from __future__ import annotations
import __future__

import ast
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

SGLANG_ROOT = Path(importlib.util.find_spec("sglang").origin).parent  # type: ignore[union-attr, arg-type]
POOL_HOST = "srt/mem_cache/pool_host"


def _alloc(dims, *, dtype, device, pin_memory=False, allocator=None, registration_granularity_bytes=None):
    """CPU stand-in for SGLang's ``ALLOC_MEMORY_FUNCS["cpu"]`` (random bytes, not zeros)."""
    return (
        torch.randint(0, 256, (int(np.prod(dims)) * dtype.itemsize,), dtype=torch.uint8)
        .view(dtype)
        .view(dims)
    )


_NAMESPACE: dict[str, Any] = {"torch": torch, "np": np, "ALLOC_MEMORY_FUNCS": {"cpu": _alloc}}


def sglang_classes(relpath: str, names: list[str], namespace: dict[str, Any]) -> dict[str, type]:
    """Compile the top-level classes ``names`` of SGLang's source file ``relpath`` (in order)."""
    path = SGLANG_ROOT / relpath
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in names]
    ns = {**_NAMESPACE, **namespace}
    code = compile(
        ast.Module(body=nodes, type_ignores=[]),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, ns)
    return {name: ns[name] for name in names}


def sglang_methods(
    relpath: str, class_name: str, names: list[str], namespace: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Compile methods ``names`` of ``class_name`` from SGLang's source file ``relpath``."""
    path = SGLANG_ROOT / relpath
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    out: dict[str, Any] = {}
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef) or node.name not in names:
            continue
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
        prop = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
        node.decorator_list = []
        ns = {**_NAMESPACE, **(namespace or {})}
        code = compile(
            ast.Module(body=[node], type_ignores=[]),
            str(path),
            "exec",
            flags=__future__.annotations.compiler_flag,
            dont_inherit=True,
        )
        exec(code, ns)
        fn = ns[node.name]
        out[node.name] = staticmethod(fn) if static else property(fn) if prop else fn
    missing = set(names) - set(out)
    assert not missing, f"SGLang {class_name} in {relpath} has no methods {sorted(missing)}"
    return out


def _with_methods(cls: type, relpath: str, class_name: str, names: list[str]) -> type:
    for name, fn in sglang_methods(relpath, class_name, names).items():
        setattr(cls, name, fn)
    return cls


_KV_METHODS = [
    "init_kv_buffer",
    "get_page_buffer_meta",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
]


class _HostBase:
    """Attributes of ``HostKVCache.__init__`` that the storage path reads."""

    dcp_size = 1
    dcp_rank = 0
    storage_format_tag = None

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
    """``MHATokenToKVPoolHost``: K and V, ``kv_buffer`` shaped by SGLang's ``init_kv_buffer``."""

    def __init__(
        self, num_pages, page_size, layer_num, head_num, head_dim, dtype=torch.bfloat16, layout="page_first"
    ):
        self._init_common(num_pages, page_size, layout, dtype)
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = (
            layer_num,
            head_num,
            head_dim,
            head_dim,
        )
        self.kv_buffer = self.init_kv_buffer()

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]


_with_methods(
    MHAHost, f"{POOL_HOST}/mha.py", "MHATokenToKVPoolHost", [*_KV_METHODS, "get_hybrid_pool_buffer"]
)


class MLAHost(_HostBase):
    """``MLATokenToKVPoolHost``: one latent KV component per page, rank-replicated."""

    def __init__(
        self, num_pages, page_size, layer_num, kv_cache_dim, dtype=torch.bfloat16, layout="page_first"
    ):
        self._init_common(num_pages, page_size, layout, dtype)
        self.layer_num, self.kv_cache_dim = layer_num, kv_cache_dim
        self.kv_buffer = self.init_kv_buffer()


_with_methods(MLAHost, f"{POOL_HOST}/mla.py", "MLATokenToKVPoolHost", [*_KV_METHODS, "_storage_page_index"])


class MambaHost(_HostBase):
    """``MambaPoolHost``: page size 1, a ``temporal`` buffer plus ``conv_i`` buffers per slot."""

    slot_state_device_tensors: tuple = ()

    def __init__(
        self,
        num_slots,
        num_layers,
        temporal_shape=(4, 8),
        conv_shapes=((6, 3), (2, 5)),
        temporal_dtype=torch.float32,
        conv_dtype=torch.bfloat16,
        layout="page_first",
    ):
        self._init_common(num_slots, 1, layout, conv_dtype)
        self._buffer_device = torch.device("cpu")
        self.num_mamba_layers = num_layers
        self.temporal_state_shape = tuple(temporal_shape)
        self.conv_state_shapes = [tuple(s) for s in conv_shapes]
        self.temporal_state_elem_size = int(np.prod(self.temporal_state_shape))
        self.conv_state_elem_sizes = [int(np.prod(s)) for s in self.conv_state_shapes]
        self.temporal_dtype, self.conv_dtype = temporal_dtype, conv_dtype
        self.size_per_token = self.get_size_per_token()
        self.kv_buffer = self.init_kv_buffer()


_with_methods(
    MambaHost,
    f"{POOL_HOST}/mamba.py",
    "MambaPoolHost",
    [
        *_KV_METHODS,
        "get_hybrid_pool_buffer",
        "_iter_page_tensors",
        "_flatten_tensor_bytes",
        "get_size_per_token",
    ],
)


def mooncake_test_mock(buffer_elements: int, entries_per_page: int, page_elements: int) -> Any:
    """SGLang's own ``create_mock_host_kv_cache`` (MooncakeStore batch test), loaded from its source."""
    path = SGLANG_ROOT / "srt/mem_cache/storage/mooncake_store/test_mooncake_store.py"
    tree = ast.parse(path.read_text())
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "create_mock_host_kv_cache"
    )
    ns = dict(_NAMESPACE)
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)
    pool, _buffer = ns["create_mock_host_kv_cache"](
        buffer_elements, entries_per_page=entries_per_page, page_elements=page_elements
    )
    return pool


def fill_random(pool: Any, seed: int) -> None:
    """Fill every host buffer of ``pool`` with reproducible random bytes."""
    g = torch.Generator().manual_seed(seed)
    for t in buffers_of(pool):
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))


def buffers_of(pool: Any) -> list[torch.Tensor]:
    getter = getattr(pool, "get_hybrid_pool_buffer", None)
    if getter is not None:
        return [t for t in getter() if t.numel()]
    return [pool.kv_buffer]


def page_bytes(pool: Any, page: int) -> bytes:
    """The bytes of host page ``page`` in SGLang's flat-page format (``get_data_page``)."""
    if hasattr(pool, "get_data_page"):
        data = pool.get_data_page(page * pool.page_size, flat=True)
        return bytes(data.contiguous().view(torch.uint8).numpy().tobytes())
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page * pool.page_size, (page + 1) * pool.page_size))
    out = b""
    base = pool.kv_buffer.data_ptr()
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    for p, s in zip(ptrs, sizes):
        out += bytes(flat[p - base : p - base + s].numpy().tobytes())
    return out
