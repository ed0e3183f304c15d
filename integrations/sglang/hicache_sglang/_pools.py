"""SGLang host pools as hicache ``HostPool`` s: zero-copy views over the SAME memory.

The geometry comes from SGLang's own storage contract, ``get_page_buffer_meta(token_indices)``,
which returns, for every page, the ``(pointer, size)`` of each run of bytes that page occupies:

* page-contiguous layouts (``page_first``, ``page_first_direct``, ``page_head``): one run per
  component and page (MHA: K then V; MLA: one; Mamba: ``temporal`` then ``conv_i``);
* ``layer_first``: one run per component, layer and page, layer-major (MHA: ``k_l, v_l`` for
  each layer ``l``).

For every component the adapter measures the page stride (and, for ``layer_first``, the layer
stride) from two pages, finds the host tensor that holds the bytes (``get_hybrid_pool_buffer()``
or ``kv_buffer``), and builds one ``torch.uint8`` ``as_strided`` view of that tensor. The view has
exactly the shape a hicache pool buffer has (``(pages, 1, run)`` for page-first,
``(layers, pages, run)`` for layer-first), so every hicache backend reads and writes SGLang's
memory in place. The views are checked against SGLang's metadata for the first, second and last
page before use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache_core import ComponentSpec, HitPolicy, HostPool, KeyFormatError, Layout, PoolError, PoolName

from ._config import PAGE_CONTIGUOUS_LAYOUTS

__all__ = ["FlatPages", "SGLangPoolView", "build_pool_view", "pool_name"]

# SGLang PoolName value -> hicache PoolName (pools hicache's key scheme knows).
_POOLS = {p.value: p for p in PoolName}


def pool_name(name: Any) -> PoolName:
    """Map an SGLang ``PoolName`` (or its value) to hicache's; unsupported pools raise ``PoolError``."""
    value = str(getattr(name, "value", name))
    try:
        return _POOLS[value]
    except KeyError:
        raise PoolError(
            f"hicache-sglang: SGLang pool {value!r} has no hicache pool; supported pools are {sorted(_POOLS)}"
        ) from None


class SGLangPoolView(HostPool):
    """A hicache pool whose component buffers are views of an SGLang host pool's tensors.

    It never allocates and cannot be re-bound: :meth:`buffers` returns the views given at
    construction, so page views and ``page_meta`` address SGLang's memory directly.
    """

    def __init__(
        self,
        specs: Sequence[ComponentSpec],
        views: Sequence[torch.Tensor],
        num_pages: int,
        *,
        layout: Layout,
        page_size: int,
        hit_policy: HitPolicy,
        rank_replicated: bool,
        source: Any,
    ) -> None:
        super().__init__(specs, num_pages, layout=layout, page_size=page_size, allocate=False)
        self.hit_policy = hit_policy
        self.rank_replicated = rank_replicated
        self.source = source
        self._views = tuple(views)

    @property
    def allocated(self) -> bool:
        return True

    def allocate(self, allocator: Any = None) -> None:
        raise PoolError("SGLangPoolView wraps SGLang's host memory; it never allocates")

    def bind(self, memory: torch.Tensor) -> None:
        raise PoolError("SGLangPoolView is bound to SGLang's host memory at construction")

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self._views

    def token_pages(self, host_indices: Any, n: int) -> list[int]:
        """Host page indices of ``n`` keys from SGLang's TOKEN host indices (``n * page_size`` of
        them; the page of key ``i`` is ``host_indices[i * page_size] // page_size``)."""
        ps = self.page_size
        if host_indices is None:
            raise PoolError("host_indices is None")
        flat = (
            host_indices.reshape(-1) if isinstance(host_indices, torch.Tensor) else torch.tensor(host_indices)
        )
        if flat.numel() != n * ps:
            raise PoolError(
                f"{flat.numel()} host indices for {n} keys of pool with page_size {ps}; SGLang passes "
                "len(keys) * page_size token indices"
            )
        firsts = flat[::ps].to(torch.int64)
        if bool((firsts % ps).any()):
            raise PoolError(f"host indices are not aligned to the page size {ps}")
        return self.check_indices((firsts // ps).tolist())


class FlatPages(HostPool):
    """The flat data pages of one legacy ``get`` / ``set`` call as a pool: page ``i`` is ``pages[i]``.

    SGLang's generic page path hands over one flat tensor per page (``get_data_page(flat=True)``);
    each is split into the components of ``like`` (the registered pool of those pages). Only the
    v1 copy path can move these pages: they are not in any registered pool.
    """

    def __init__(self, name: PoolName, like: HostPool, pages: Sequence[Any]) -> None:
        super().__init__(
            like.specs, max(1, len(pages)), layout=like.layout, page_size=like.page_size, allocate=False
        )
        self.hit_policy = like.hit_policy
        self.rank_replicated = like.rank_replicated
        self._pages = [self._split(name, like, t) for t in pages]

    @staticmethod
    def _split(name: PoolName, like: HostPool, tensor: Any) -> tuple[torch.Tensor, ...]:
        if not isinstance(tensor, torch.Tensor):
            raise KeyFormatError(
                "hicache-sglang: legacy get/set take a flat page tensor (SGLang's generic page path); "
                f"got {type(tensor).__name__}"
            )
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise PoolError("hicache-sglang: legacy page tensors must be contiguous CPU tensors")
        flat = tensor.view(-1).view(torch.uint8)
        if flat.numel() != like.page_nbytes:
            raise PoolError(
                f"hicache-sglang: flat page of {flat.numel()} bytes for pool {name.value!r} whose "
                f"pages hold {like.page_nbytes} bytes"
            )
        return tuple(torch.split(flat, list(like.component_nbytes)))  # views, one per component

    def page_views(self, indices: Iterable[int]) -> list[tuple[torch.Tensor, ...]]:
        return [self._pages[i] for i in indices]


@dataclass(frozen=True)
class _Geometry:
    """Byte geometry of one component: ``runs`` runs of ``size`` bytes per page."""

    base: int
    size: int
    runs: int
    page_stride: int
    run_stride: int

    def extent(self, num_pages: int) -> int:
        """Bytes from ``base`` to the end of the last run of page ``num_pages - 1``."""
        return (num_pages - 1) * self.page_stride + (self.runs - 1) * self.run_stride + self.size


def _meta(pool: Any, token_indices: Sequence[int]) -> tuple[list[int], list[int]]:
    ptrs, sizes = pool.get_page_buffer_meta(torch.tensor(list(token_indices), dtype=torch.int64))
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def _page_meta(pool: Any, page: int, page_size: int) -> tuple[list[int], list[int]]:
    return _meta(pool, range(page * page_size, (page + 1) * page_size))


def _candidates(pool: Any) -> list[torch.Tensor]:
    """The host tensors that may hold the pool's pages (deduplicated)."""
    found: list[Any] = []
    getter = getattr(pool, "get_hybrid_pool_buffer", None)
    if callable(getter):
        try:
            found.extend(getter() or ())
        except Exception:  # optional API; kv_buffer below is the fallback
            pass
    kv = getattr(pool, "kv_buffer", None)
    found.extend(kv if isinstance(kv, (list, tuple)) else [kv])
    out: list[torch.Tensor] = []
    seen: set[tuple[int, int]] = set()
    for t in found:
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type != "cpu":
            continue
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise PoolError(
            f"hicache-sglang: host buffer of shape {tuple(t.shape)} is not contiguous; zero-copy views "
            "need contiguous host tensors"
        )
    return t.detach().view(-1).view(torch.uint8)


def _runs_per_component(pool: Any, layout: str, entries: int) -> tuple[int, int]:
    """``(components, runs)`` from the number of metadata entries of one page."""
    if layout in PAGE_CONTIGUOUS_LAYOUTS:
        return entries, 1
    if layout == "layer_first":
        layers = int(getattr(pool, "layer_num", 0) or 0)
        if layers <= 0 or entries % layers:
            raise PoolError(
                f"hicache-sglang: layer_first pool {type(pool).__name__} reports {entries} buffer runs "
                f"per page, not a multiple of its layer_num={layers}"
            )
        return entries // layers, layers
    raise PoolError(
        f"hicache-sglang: SGLang host layout {layout!r} is not supported; use page_first, "
        "page_first_direct, page_head or layer_first"
    )


def _component_names(name: PoolName, pool: Any, count: int) -> list[str]:
    if name in (PoolName.KV, PoolName.DRAFT):
        if count == 1:
            return ["kv"]
        if count == 2:
            return ["k", "v"]
    elif name is PoolName.MAMBA:
        convs = len(getattr(pool, "conv_buffer", ()) or ())
        if count == convs + 1:
            return ["temporal", *(f"conv_{i}" for i in range(convs))]
        if count == convs:
            return [f"conv_{i}" for i in range(convs)]
    elif name is PoolName.INDEXER and count == 1:
        return ["indexer"]
    return [f"part{i}" for i in range(count)]


def _geometries(pool: Any, layout: str, page_size: int, two_pages: bool) -> list[_Geometry]:
    ptrs0, sizes0 = _page_meta(pool, 0, page_size)
    if not ptrs0 or len(ptrs0) != len(sizes0):
        raise PoolError(
            f"hicache-sglang: {type(pool).__name__}.get_page_buffer_meta returned "
            f"{len(ptrs0)} pointers and {len(sizes0)} sizes for one page"
        )
    ptrs1 = _page_meta(pool, 1, page_size)[0] if two_pages else ptrs0
    ncomp, runs = _runs_per_component(pool, layout, len(ptrs0))
    geoms = []
    for c in range(ncomp):
        idx = [r * ncomp + c for r in range(runs)]  # layer-major: run r of component c
        sizes = {sizes0[i] for i in idx}
        if len(sizes) != 1:
            raise PoolError(f"hicache-sglang: component {c} has runs of different sizes {sorted(sizes)}")
        size = sizes.pop()
        base = ptrs0[idx[0]]
        run_stride = ptrs0[idx[1]] - base if runs > 1 else size
        page_stride = ptrs1[idx[0]] - base if two_pages else size * runs
        if page_stride <= 0 or run_stride <= 0 or size <= 0:
            raise PoolError(
                f"hicache-sglang: component {c} of {type(pool).__name__} has a non-increasing page "
                f"geometry (page stride {page_stride}, run stride {run_stride}, size {size})"
            )
        geoms.append(_Geometry(base, size, runs, page_stride, run_stride))
    return geoms


def _owner(geom: _Geometry, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    for t in tensors:
        start = t.data_ptr()
        if start <= geom.base and geom.base + geom.extent(1) <= start + t.numel() * t.element_size():
            return t
    raise PoolError(
        f"hicache-sglang: no host tensor of the pool holds address {geom.base:#x}; the pool must "
        "expose its buffers through get_hybrid_pool_buffer() or kv_buffer"
    )


def _view(geom: _Geometry, tensor: torch.Tensor, num_pages: int, page_first: bool) -> torch.Tensor:
    flat = _flat_bytes(tensor)
    offset = flat.storage_offset() + (geom.base - flat.data_ptr())
    if page_first:
        return flat.as_strided((num_pages, 1, geom.size), (geom.page_stride, geom.size, 1), offset)
    return flat.as_strided((geom.runs, num_pages, geom.size), (geom.run_stride, geom.page_stride, 1), offset)


def _fit(geom: _Geometry, tensor: torch.Tensor) -> int:
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return (end - geom.base - geom.extent(1)) // geom.page_stride + 1


def _check(view_pool: SGLangPoolView, pool: Any, page_size: int) -> None:
    """Compare the views' addresses with SGLang's metadata for the first, second and last page."""
    n = view_pool.num_pages
    bufs = view_pool.buffers()
    ncomp = len(bufs)
    for page in sorted({0, min(1, n - 1), n - 1}):
        ptrs, sizes = _page_meta(pool, page, page_size)
        for c, b in enumerate(bufs):
            runs = (
                [b[page]]
                if view_pool.layout is Layout.PAGE_FIRST
                else [b[r, page] for r in range(b.shape[0])]
            )
            for r, run in enumerate(runs):
                i = r * ncomp + c
                if run.data_ptr() != ptrs[i] or run.numel() != sizes[i]:
                    raise PoolError(
                        f"hicache-sglang: zero-copy view of {type(pool).__name__} disagrees with "
                        f"get_page_buffer_meta at page {page}, component {c}, run {r} "
                        f"({run.data_ptr():#x}/{run.numel()} vs {ptrs[i]:#x}/{sizes[i]})"
                    )


def build_pool_view(name: PoolName, pool: Any, *, is_mla_model: bool) -> SGLangPoolView:
    """Wrap SGLang host pool ``pool`` registered as ``name`` in a zero-copy :class:`SGLangPoolView`.

    Raises :class:`hicache_core.PoolError` when the pool does not expose usable page metadata
    (for example Mamba pools with slot side states, or logical anchors without a ``kv_buffer``).
    """
    layout = str(getattr(pool, "layout", "page_first"))
    page_size = int(getattr(pool, "page_size", 1) or 1)
    if not callable(getattr(pool, "get_page_buffer_meta", None)):
        raise PoolError(f"hicache-sglang: {type(pool).__name__} has no get_page_buffer_meta(indices)")
    tensors = _candidates(pool)
    if not tensors:
        raise PoolError(
            f"hicache-sglang: {type(pool).__name__} exposes no CPU host tensor (kv_buffer is None?); "
            "logical anchor pools are not supported"
        )
    size = getattr(pool, "size", None)
    declared = int(size) // page_size if isinstance(size, int) and size > 0 else None
    try:
        geoms = _geometries(pool, layout, page_size, two_pages=declared is None or declared > 1)
    except PoolError:
        raise
    except Exception as err:
        raise PoolError(
            f"hicache-sglang: {type(pool).__name__}.get_page_buffer_meta failed ({type(err).__name__}: "
            f"{err}); zero-copy hicache storage needs it for pool {name.value!r}"
        ) from None
    owners = [_owner(g, tensors) for g in geoms]
    fits = min(_fit(g, t) for g, t in zip(geoms, owners))
    num_pages = min(fits, declared) if declared is not None else fits
    if num_pages <= 0:
        raise PoolError(f"hicache-sglang: {type(pool).__name__} holds no complete page")
    page_first = geoms[0].runs == 1
    if any((g.runs == 1) != page_first for g in geoms):
        raise PoolError("hicache-sglang: components of one pool mix page-first and layer-first runs")
    names = _component_names(name, pool, len(geoms))
    specs = [ComponentSpec(n, g.runs, (g.size,), torch.uint8) for n, g in zip(names, geoms)]
    views = [_view(g, t, num_pages, page_first) for g, t in zip(geoms, owners)]
    replicated = (name is PoolName.KV and is_mla_model) or (
        name in (PoolName.INDEXER, PoolName.DRAFT) and is_mla_model and len(geoms) == 1
    )
    view_pool = SGLangPoolView(
        specs,
        views,
        num_pages,
        layout=Layout.PAGE_FIRST if page_first else Layout.LAYER_FIRST,
        page_size=page_size,
        hit_policy=HitPolicy.TRAILING_PAGES if name is PoolName.MAMBA else HitPolicy.ALL_PAGES,
        rank_replicated=replicated,
        source=pool,
    )
    _check(view_pool, pool, page_size)
    return view_pool
