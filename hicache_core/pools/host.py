"""Host memory pools: CPU torch tensors holding KV, Mamba state, DSA indexer and draft pages.

Every pool is a set of *components* (``k``/``v`` for MHA, ``kv`` for MLA, ``temporal`` and
``conv_i`` for Mamba, ``indexer`` for DSA). Each component is one ``torch.uint8`` buffer:

* ``page_first``: shape ``(num_pages, num_layers, bytes_per_layer)``; a page of a component
  is one contiguous run of bytes, so zero-copy backends can move it by ``(ptr, size)``;
* ``layer_first``: shape ``(num_layers, num_pages, bytes_per_layer)``; a page is a strided
  view (one run per layer) and is moved by copy.

The byte order of a page view is the same in both layouts (layer-major), so a page stored from
one layout reads back correctly into the other. Typed views (``pool.typed("k")``) expose the
logical dtype and shape for the engine.

Every constructor checks its arguments first (``pools/_args.py``): a wrong type raises
:class:`~hicache_core.errors.ArgumentTypeError`, a wrong value :class:`PoolError`, each naming
the argument. A ``dtype`` may be a ``torch.dtype`` or its name: ``"bfloat16"``,
``"torch.float16"``, or one of the aliases ``bf16``/``fp16``/``fp32``/``fp8_e4m3``/``fp8_e5m2``.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import ArgumentTypeError, BatchShapeError, BatchTypeError, HiCacheError, PoolError
from ..types import HitPolicy, Layout
from ._args import as_dtype, as_int, as_layout, as_shape, check_allocator, check_name

if TYPE_CHECKING:  # pragma: no cover
    from ..config import StorageConfig

__all__ = [
    "Allocator",
    "ComponentSpec",
    "HostPool",
    "IndexerPool",
    "MHAKVPool",
    "MLAKVPool",
    "MambaPool",
    "torch_allocator",
]

Allocator = Callable[[int], torch.Tensor]
"""``alloc(nbytes) -> flat torch.uint8 CPU tensor`` of exactly ``nbytes`` bytes."""

ALIGN = 64  # component buffers carved from one region start on a cache line


IO_ALIGN = 4096
"""The default allocator's regions start on this boundary: ``O_DIRECT`` needs block-aligned
memory, so a page view whose offset and size are multiples of it moves between the pool and the
disk with no staging copy (torch's own CPU memory is only 64-byte aligned)."""

HUGE_PAGE = 2 << 20
"""Regions of at least this size start on this boundary and are advised ``MADV_HUGEPAGE`` before
they are first touched: with transparent huge pages in ``madvise`` mode (a common default) they
are otherwise backed by 4 KiB pages, and ``O_DIRECT`` into them pins every 4 KiB page per I/O,
which made zero-copy reads slower than a copy through a small reused buffer. The price: the
kernel may compact memory to find huge pages, so a multi-GiB pool can take a few seconds longer
to allocate (``benchmarks/README.md``)."""


def _find_madvise() -> Callable[[int, int], object] | None:
    """``madvise(addr, nbytes, MADV_HUGEPAGE)`` through libc, or ``None`` where it is missing."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is None:
        return None
    try:
        fn = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lambda addr, nbytes: fn(addr, nbytes, advice)


_madvise_huge = _find_madvise()


def torch_allocator(nbytes: int) -> torch.Tensor:
    """The default allocator: zeroed, plain torch CPU memory starting on an ``IO_ALIGN``
    boundary; a region of ``HUGE_PAGE`` bytes or more starts on a ``HUGE_PAGE`` boundary and is
    advised to use transparent huge pages."""
    align = HUGE_PAGE if nbytes >= HUGE_PAGE else IO_ALIGN
    raw = torch.empty(nbytes + align - 1, dtype=torch.uint8)
    start = -raw.data_ptr() % align
    region = raw[start : start + nbytes]
    if align == HUGE_PAGE and _madvise_huge is not None:
        # before the first touch (zero_); if refused, ordinary pages: only slower
        _madvise_huge(region.data_ptr(), nbytes)
    return region.zero_()


@dataclass(frozen=True)
class ComponentSpec:
    """One component of a page: ``num_layers`` blocks of ``shape`` elements of ``dtype``.

    ``dtype`` may be given by name (``"bfloat16"``); it is stored as the ``torch.dtype``.
    """

    name: str
    num_layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        check_name(self.name, "ComponentSpec: name")
        object.__setattr__(self, "num_layers", as_int(self.num_layers, "ComponentSpec: num_layers", 1))
        object.__setattr__(self, "shape", as_shape(self.shape, "ComponentSpec: shape"))
        object.__setattr__(self, "dtype", as_dtype(self.dtype, "ComponentSpec: dtype"))

    @property
    def bytes_per_layer(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def page_nbytes(self) -> int:
        return self.num_layers * self.bytes_per_layer


def _itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostPool:
    """A host pool of ``num_pages`` pages (slots), each made of the given components.

    Construct with ``allocate=False`` to plan a pool whose memory will come from the store
    (see :meth:`HostPoolGroup.allocate`). Subclasses only choose components, the hit policy
    and whether the data is the same on every rank (``rank_replicated``).
    """

    hit_policy: HitPolicy = HitPolicy.ALL_PAGES
    rank_replicated: bool = False

    def __init__(
        self,
        components: Sequence[ComponentSpec],
        num_pages: int,
        *,
        layout: Layout | str = Layout.PAGE_FIRST,
        page_size: int = 1,
        allocate: bool = True,
        allocator: Allocator | None = None,
    ) -> None:
        owner = type(self).__name__
        num_pages = as_int(num_pages, f"{owner}: num_pages", 1)
        page_size = as_int(page_size, f"{owner}: page_size", 1)
        layout = as_layout(layout, f"{owner}: layout")
        check_allocator(allocator, f"{owner}: allocator")
        if isinstance(components, (str, bytes)) or not isinstance(components, Sequence):
            raise ArgumentTypeError(
                f"{owner}: components must be a sequence of ComponentSpec, got {type(components).__name__}"
            )
        if not components:
            raise PoolError(f"{type(self).__name__}: a pool needs at least one component")
        for c in components:
            if not isinstance(c, ComponentSpec):
                raise ArgumentTypeError(f"{owner}: components must be ComponentSpec, got {type(c).__name__}")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise PoolError(f"{type(self).__name__}: duplicate component names {names}")
        for c in components:
            if c.num_layers <= 0 or c.page_nbytes < 0 or any(d < 0 for d in c.shape):
                raise PoolError(f"{type(self).__name__}: invalid component {c}")
        self.specs: tuple[ComponentSpec, ...] = tuple(components)
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout
        self._buffers: tuple[torch.Tensor, ...] | None = None
        if allocate:
            self.allocate(allocator or torch_allocator)

    # ----------------------------------------------------------------- geometry
    @property
    def components(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.specs)

    @property
    def component_nbytes(self) -> tuple[int, ...]:
        """Bytes of one page of each component."""
        return tuple(c.page_nbytes for c in self.specs)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page over all components."""
        return sum(self.component_nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes this pool needs when carved from one region (components 64-byte aligned)."""
        return sum(_aligned(c.page_nbytes * self.num_pages) for c in self.specs)

    # --------------------------------------------------------------- allocation
    @property
    def allocated(self) -> bool:
        return self._buffers is not None

    def allocate(self, allocator: Allocator = torch_allocator) -> None:
        """Allocate this pool's memory as one region from ``allocator``."""
        self.bind(_checked_alloc(allocator, self.nbytes))

    def bind(self, memory: torch.Tensor) -> None:
        """Carve the component buffers out of ``memory`` (a flat uint8 CPU tensor)."""
        if self._buffers is not None:
            raise PoolError(f"{type(self).__name__}: pool memory is already allocated")
        check_region(memory, self.nbytes)
        buffers = []
        offset = 0
        for c in self.specs:
            n = c.page_nbytes * self.num_pages
            flat = memory[offset : offset + n]
            if self.layout is Layout.PAGE_FIRST:
                buf = flat.view(self.num_pages, c.num_layers, c.bytes_per_layer)
            else:
                buf = flat.view(c.num_layers, self.num_pages, c.bytes_per_layer)
            buffers.append(buf)
            offset += _aligned(n)
        self._buffers = tuple(buffers)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The underlying uint8 buffers, one per component, in component order."""
        if self._buffers is None:
            raise PoolError(
                f"{type(self).__name__} is not allocated yet; call allocate() or let "
                "CacheController / HostPoolGroup.allocate() take memory from the store"
            )
        return self._buffers

    def buffer(self, component: str) -> torch.Tensor:
        try:
            i = self.components.index(component)
        except ValueError:
            raise PoolError(
                f"{type(self).__name__} has no component {component!r}; "
                f"components are {list(self.components)}"
            ) from None
        return self.buffers()[i]

    def typed(self, component: str) -> torch.Tensor:
        """A typed view of one component: ``(pages, layers, *shape)`` or ``(layers, pages, *shape)``."""
        spec = self.specs[self.components.index(component)]
        buf = self.buffer(component)
        lead = tuple(buf.shape[:2])
        return buf.view(spec.dtype).view(*lead, *spec.shape)

    # -------------------------------------------------------------------- pages
    def check_indices(self, indices: Iterable[int]) -> list[int]:
        """Validate host page indices and return them as a list of ints."""
        tolist = getattr(indices, "tolist", None)
        try:
            if tolist is None and isinstance(indices, _NOT_INDICES):
                raise TypeError  # iterable, but not an ordered sequence of page indices
            out = _as_indices(tolist() if tolist is not None else indices)
        except (TypeError, ValueError, NotImplementedError, RuntimeError):  # e.g. a meta-device tensor
            raise BatchTypeError(
                f"host page indices must be integers (a sequence of int or an integer tensor), got {indices!r:.80}"
            ) from None
        if out and (min(out) < 0 or max(out) >= self.num_pages):
            bad = next(i for i in out if i < 0 or i >= self.num_pages)
            raise BatchShapeError(
                f"host page index {bad} is out of range for {type(self).__name__} with "
                f"{self.num_pages} pages (valid: 0..{self.num_pages - 1})"
            )
        return out

    def page_views(self, indices: Iterable[int]) -> list[tuple[torch.Tensor, ...]]:
        """Per page, one uint8 view per component (contiguous only for ``page_first``)."""
        idx = self.check_indices(indices)
        bufs = self.buffers()
        if self.layout is Layout.PAGE_FIRST:
            if not idx:
                return []
            runs = _runs(idx)  # one tensor op per run of consecutive pages, not per page
            cols: list[list[torch.Tensor]] = []
            for b in bufs:
                flat = b.view(b.shape[0], -1)
                col: list[torch.Tensor] = []
                for start, stop in runs:
                    col.extend(flat[start:stop].unbind(0))
                cols.append(col)
            return list(zip(*cols))
        return [tuple(b[:, i, :] for b in bufs) for i in idx]

    def page_meta(self, indices: Iterable[int]) -> list[tuple[tuple[int, int], ...]]:
        """Per page, ``(ptr, size)`` of each component, for zero-copy transports.

        Only ``page_first`` pools have contiguous pages; a ``layer_first`` pool raises
        :class:`PoolError`.
        """
        if self.layout is not Layout.PAGE_FIRST:
            raise PoolError(
                f"{type(self).__name__} uses the layer_first layout; zero-copy needs "
                "page_first (set layout='page_first' in the config and the pools)"
            )
        idx = self.check_indices(indices)
        metas = [(b.data_ptr(), b.stride(0), b[0].numel()) for b in self.buffers()]
        return [tuple((base + i * stride, size) for base, stride, size in metas) for i in idx]

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "planned"
        return (
            f"{type(self).__name__}(pages={self.num_pages}, page_size={self.page_size}, "
            f"layout={self.layout.value}, components={list(self.components)}, "
            f"page_nbytes={self.page_nbytes}, {state})"
        )


def _as_indices(values: Iterable[int]) -> list[int]:
    """``[operator.index(v) for v in values]``; a list of exact ints (what ``tolist()`` gives) is
    only copied. The copy is what gets checked and returned."""
    out = list(values)
    if operator.countOf(map(type, out), int) != len(out):
        out = [_index(i) for i in out]
    return out


def _index(value: object) -> int:
    if isinstance(value, bool):  # a boolean mask is not a list of page indices
        raise TypeError("bool")
    return operator.index(value)  # type: ignore[arg-type]


# Iterables that are not an ordered sequence of page indices: a string or bytes (its characters /
# byte values), a set (no order), a mapping (its keys).
_NOT_INDICES = (str, bytes, bytearray, memoryview, set, frozenset, dict)


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """``[3, 4, 5, 9]`` -> ``[(3, 6), (9, 10)]``: half-open runs of consecutive indices."""
    out = []
    start = prev = idx[0]
    for i in idx[1:]:
        if i != prev + 1:
            out.append((start, prev + 1))
            start = i
        prev = i
    out.append((start, prev + 1))
    return out


def _checked_alloc(allocator: Allocator, nbytes: int) -> torch.Tensor:
    check_allocator(allocator, "allocator")
    try:
        memory = allocator(nbytes)
    except HiCacheError:
        raise
    except (RuntimeError, MemoryError, OverflowError, ValueError) as err:  # torch: cannot allocate
        raise PoolError(f"cannot allocate {nbytes} bytes of host pool memory: {err}") from err
    check_region(memory, nbytes)
    return memory


def check_region(memory: torch.Tensor, nbytes: int) -> None:
    if not isinstance(memory, torch.Tensor):
        raise PoolError(f"pool memory must be a torch.Tensor, got {type(memory).__name__}")
    if memory.dtype != torch.uint8 or memory.dim() != 1 or not memory.is_contiguous():
        raise PoolError("pool memory must be a flat, contiguous torch.uint8 tensor")
    if memory.device.type != "cpu":
        raise PoolError(f"pool memory must be on the CPU, got device {memory.device}")
    if memory.numel() < nbytes:
        raise PoolError(f"pool memory holds {memory.numel()} bytes but {nbytes} are needed")


class MHAKVPool(HostPool):
    """MHA KV cache: components ``k`` and ``v``, each ``(page_size, num_heads, head_dim)`` per layer."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        layout: Layout | str = Layout.PAGE_FIRST,
        allocate: bool = True,
        allocator: Allocator | None = None,
    ) -> None:
        what = type(self).__name__
        shape = (
            as_int(page_size, f"{what}: page_size", 1),
            as_int(num_heads, f"{what}: num_heads", 1),
            as_int(head_dim, f"{what}: head_dim", 1),
        )
        num_layers = as_int(num_layers, f"{what}: num_layers", 1)
        self.dtype = dtype = as_dtype(dtype, f"{what}: dtype")
        super().__init__(
            [ComponentSpec("k", num_layers, shape, dtype), ComponentSpec("v", num_layers, shape, dtype)],
            num_pages,
            layout=layout,
            page_size=page_size,
            allocate=allocate,
            allocator=allocator,
        )


class MLAKVPool(HostPool):
    """MLA KV cache: one component ``kv`` of ``(page_size, kv_dim)`` per layer, rank-replicated."""

    rank_replicated = True

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        layout: Layout | str = Layout.PAGE_FIRST,
        allocate: bool = True,
        allocator: Allocator | None = None,
    ) -> None:
        what = type(self).__name__
        shape = (as_int(page_size, f"{what}: page_size", 1), as_int(kv_dim, f"{what}: kv_dim", 1))
        num_layers = as_int(num_layers, f"{what}: num_layers", 1)
        self.dtype = dtype = as_dtype(dtype, f"{what}: dtype")
        super().__init__(
            [ComponentSpec("kv", num_layers, shape, dtype)],
            num_pages,
            layout=layout,
            page_size=page_size,
            allocate=allocate,
            allocator=allocator,
        )


class MambaPool(HostPool):
    """Mamba state: one slot per page index; a ``temporal`` buffer plus ``conv_0..conv_n``.

    Only the state at the end of a prefix is needed to resume, so the hit policy is
    ``TRAILING_PAGES``. State differs per TP rank.
    """

    hit_policy = HitPolicy.TRAILING_PAGES

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        temporal_shape: Sequence[int],
        conv_shapes: Sequence[Sequence[int]],
        temporal_dtype: torch.dtype = torch.float32,
        conv_dtype: torch.dtype = torch.bfloat16,
        *,
        layout: Layout | str = Layout.PAGE_FIRST,
        allocate: bool = True,
        allocator: Allocator | None = None,
    ) -> None:
        what = type(self).__name__
        num_layers = as_int(num_layers, f"{what}: num_layers", 1)
        temporal_shape = as_shape(temporal_shape, f"{what}: temporal_shape")
        if isinstance(conv_shapes, (str, bytes)) or not isinstance(conv_shapes, Sequence):
            raise ArgumentTypeError(
                f"{what}: conv_shapes must be a sequence of shapes, got {type(conv_shapes).__name__}"
            )
        convs = [as_shape(c, f"{what}: conv_shapes[{i}]") for i, c in enumerate(conv_shapes)]
        temporal_dtype = as_dtype(temporal_dtype, f"{what}: temporal_dtype")
        conv_dtype = as_dtype(conv_dtype, f"{what}: conv_dtype")
        specs = []
        if math.prod(temporal_shape) > 0:
            specs.append(ComponentSpec("temporal", num_layers, temporal_shape, temporal_dtype))
        specs += [ComponentSpec(f"conv_{i}", num_layers, c, conv_dtype) for i, c in enumerate(convs)]
        super().__init__(specs, num_slots, layout=layout, allocate=allocate, allocator=allocator)

    @classmethod
    def for_node(
        cls,
        config: StorageConfig,
        num_layers: int,
        temporal_shape: Sequence[int],
        conv_shapes: Sequence[Sequence[int]],
        temporal_dtype: torch.dtype = torch.float32,
        conv_dtype: torch.dtype = torch.bfloat16,
        *,
        num_slots: int | None,
        max_running_requests: int,
        pre_alloc_size: int = 0,
        extra_buffer: bool,
        overlap_schedule: bool,
        layout: Layout | str | None = None,
        allocate: bool = True,
        allocator: Allocator | None = None,
    ) -> MambaPool:
        """A Mamba pool sized for this node.

        On a PD decode node (``config.disaggregation_mode == "decode"``) the slot count comes from
        :func:`hicache_core.sizing.decode_mamba_pool_size` (``num_slots`` is the configured size,
        raised with a warning when too small; ``None`` means "exactly what is needed").
        ``extra_buffer`` is the scheduler's strategy *before* the decode normalisation: the
        config then holds ``no_buffer``, so pass what the operator asked for, not
        ``config.mamba_scheduler_strategy == "extra_buffer"``. Elsewhere
        ``num_slots`` is required and used as is.
        """
        from ..config import StorageConfig
        from .sizing import decode_mamba_pool_size

        if not isinstance(config, StorageConfig):
            raise ArgumentTypeError(
                f"MambaPool.for_node: config must be a StorageConfig, got {type(config).__name__}"
            )
        if config.disaggregation_mode == "decode":
            num_slots = decode_mamba_pool_size(
                max_running_requests,
                pre_alloc_size,
                num_slots,
                extra_buffer=extra_buffer,
                overlap_schedule=overlap_schedule,
            )
        elif num_slots is None:
            raise PoolError("MambaPool.for_node: pass num_slots (only PD decode nodes derive it)")
        return cls(
            num_slots,
            num_layers,
            temporal_shape,
            conv_shapes,
            temporal_dtype,
            conv_dtype,
            layout=config.layout if layout is None else layout,
            allocate=allocate,
            allocator=allocator,
        )


class IndexerPool(HostPool):
    """DSA (NSA) indexer cache: one component ``indexer`` of ``(page_size, index_dim)`` per layer.

    Every page of a prefix is needed (``ALL_PAGES``); like MLA KV it is rank-replicated.
    """

    rank_replicated = True

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        index_dim: int,
        dtype: torch.dtype = torch.uint8,
        *,
        layout: Layout | str = Layout.PAGE_FIRST,
        allocate: bool = True,
        allocator: Allocator | None = None,
    ) -> None:
        what = type(self).__name__
        shape = (as_int(page_size, f"{what}: page_size", 1), as_int(index_dim, f"{what}: index_dim", 1))
        num_layers = as_int(num_layers, f"{what}: num_layers", 1)
        dtype = as_dtype(dtype, f"{what}: dtype")
        super().__init__(
            [ComponentSpec("indexer", num_layers, shape, dtype)],
            num_pages,
            layout=layout,
            page_size=page_size,
            allocate=allocate,
            allocator=allocator,
        )
