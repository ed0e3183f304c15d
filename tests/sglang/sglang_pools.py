"""SGLang host pools for the adapter tests, running SGLang 0.5.23's OWN storage-path code.

The pool classes (``MHAHost``, ``MLAHost``, ``MambaHost``) are ``hicache_sglang.testing``'s, the
helper third-party authors use; this module adds what only the project's own tests need.

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
from hicache_sglang.testing import MambaHost, MHAHost, MLAHost, buffers_of, fill_random

__all__ = [
    "MHAHost",
    "MLAHost",
    "MambaHost",
    "buffers_of",
    "fill_random",
    "mooncake_test_mock",
    "page_bytes",
    "sglang_classes",
    "sglang_methods",
]

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
