"""``ExternalPool``: a host pool over memory an engine owns (its KV cache), without copying.

An engine such as vLLM keeps its KV cache in per-layer tensors whose first dimension is the
block (page) index. :meth:`ExternalPool.from_block_tensors` reads the geometry of one block from
the tensors' shapes and strides, and returns a pool whose single component is a ``torch.uint8``
``as_strided`` view of the SAME storage, so every backend reads and writes the engine's blocks in
place:

* one block of one layer tensor is decomposed into *runs*: a block whose dimensions tile one
  range of memory in some order (row-major, or permuted as ``[N, H, C]`` memory viewed as
  ``[H, N, C]``) is one run of its bytes in memory order; otherwise the longest contiguous suffix
  of its dimensions is one run, and every index of the dimensions before it (e.g. heads stored
  outside the block) is another run;
* the runs of all layers (layer by layer, in the order given) must be equally spaced (one run
  stride) and every block must move by one block stride, in one storage: then one page is
  ``runs`` runs of ``run`` bytes, and the pool is one component of ``runs`` "layers";
* runs that tile a block contiguously give a ``page_first`` pool (one run of bytes per page,
  zero-copy capable); anything else (layers outermost, as vLLM's ``LBHNC`` CPU layout) gives a
  ``layer_first`` pool whose pages are strided views, moved by copy.

The page bytes are the block's bytes in the engine's own order; the caller must put that
format (engine, layout, block size) into the key namespace so other formats never share keys.
Geometries that do not reduce to one component raise :class:`~hicache_core.PoolError` naming
what differs. Only CPU tensors are accepted: device memory needs a staging copy first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ArgumentTypeError, PoolError
from ..types import HitPolicy, Layout
from ._args import as_int, check_name
from .host import ComponentSpec, HostPool

__all__ = ["BlockGeometry", "ExternalPool", "block_geometry"]


@dataclass(frozen=True)
class BlockGeometry:
    """Where the bytes of block ``b`` are: ``runs`` runs of ``run_nbytes`` bytes, run ``r`` at
    ``base + r * run_stride + b * block_stride`` (byte addresses, strides in bytes)."""

    base: int
    runs: int
    run_nbytes: int
    run_stride: int
    block_stride: int
    num_blocks: int

    @property
    def page_first(self) -> bool:
        """True when a block is one contiguous run of bytes (``runs * run_nbytes``)."""
        return self.runs == 1 or self.run_stride == self.run_nbytes

    @property
    def page_nbytes(self) -> int:
        return self.runs * self.run_nbytes

    def extent(self) -> int:
        """Bytes from ``base`` to the end of the last byte of the last block."""
        return (self.runs - 1) * self.run_stride + (self.num_blocks - 1) * self.block_stride + self.run_nbytes


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether dims of ``shape``/``strides``, in some order, tile one contiguous range exactly."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def _tensor_runs(t: torch.Tensor, what: str) -> tuple[list[int], int]:
    """Byte offsets (from ``t.data_ptr()``) of the contiguous runs of block 0, and the run size.

    A block whose dims are a permutation of a dense layout (e.g. ``[H, N, C]`` viewed over
    ``[N, H, C]`` memory) is one run: its bytes in memory order.
    """
    es = t.element_size()
    shape, strides = list(t.shape[1:]), list(t.stride()[1:])
    if any(s < 0 for s in strides) or t.stride(0) <= 0:
        raise PoolError(f"{what}: negative or zero strides {tuple(t.stride())} are not supported")
    if _dense(shape, strides):
        return [0], math.prod(shape) * es
    # the longest suffix of dims laid out contiguously is one run
    k, expected = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expected):
        expected *= shape[k - 1]
        k -= 1
    run = math.prod(shape[k:]) * es
    outer = [range(n) for n in shape[:k]]
    offsets = [sum(i * s * es for i, s in zip(idx, strides)) for idx in itertools.product(*outer)]
    return offsets, run


def block_geometry(tensors: Sequence[torch.Tensor]) -> BlockGeometry:
    """The :class:`BlockGeometry` of per-layer tensors whose dim 0 is the block index.

    Tensors that alias the same memory with the same geometry (layers sharing one KV cache)
    count once. Raises :class:`PoolError` when the blocks do not reduce to equally spaced runs of
    one size in one storage, or a tensor is not a CPU tensor; :class:`ArgumentTypeError` when an
    item is not a tensor.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence) or not tensors:
        raise ArgumentTypeError("block_geometry: pass a non-empty sequence of per-layer tensors")
    unique: list[torch.Tensor] = []
    seen: set[tuple[Any, ...]] = set()
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(
                f"block_geometry: tensors[{i}] is a {type(t).__name__}, not a torch.Tensor"
            )
        if t.device.type != "cpu":
            raise PoolError(
                f"block_geometry: tensors[{i}] is on {t.device}; an ExternalPool views host memory only "
                "(copy device blocks through a host staging pool)"
            )
        if t.dim() < 2 or t.shape[0] < 1:
            raise PoolError(
                f"block_geometry: tensors[{i}] has shape {tuple(t.shape)}; dim 0 must index blocks"
            )
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in seen:
            seen.add(key)
            unique.append(t)
    first = unique[0]
    num_blocks, block_stride = first.shape[0], first.stride(0) * first.element_size()
    storage = first.untyped_storage().data_ptr()
    bases: list[int] = []
    run_nbytes = None
    for i, t in enumerate(unique):
        what = f"block_geometry: layer tensor {i}"
        if t.shape[0] != num_blocks or t.stride(0) * t.element_size() != block_stride:
            raise PoolError(
                f"{what} has {t.shape[0]} blocks of stride {t.stride(0) * t.element_size()} bytes, the "
                f"first {num_blocks} of stride {block_stride}: all layers must share one block geometry"
            )
        if t.untyped_storage().data_ptr() != storage:
            raise PoolError(f"{what} lives in another allocation; all layers must share one storage")
        offsets, run = _tensor_runs(t, what)
        if run_nbytes is not None and run != run_nbytes:
            raise PoolError(f"{what} has runs of {run} bytes, the others {run_nbytes}")
        run_nbytes = run
        bases.extend(t.data_ptr() + o for o in offsets)
    assert run_nbytes is not None
    run_stride = bases[1] - bases[0] if len(bases) > 1 else run_nbytes
    if any(b - a != run_stride for a, b in itertools.pairwise(bases)):
        raise PoolError(
            "block_geometry: the runs of the layers are not equally spaced (first offsets "
            f"{[b - bases[0] for b in bases[:4]]}...); one component cannot view them"
        )
    geom = BlockGeometry(bases[0], len(bases), run_nbytes, run_stride, block_stride, num_blocks)
    _check_disjoint(geom)
    nbytes = first.untyped_storage().nbytes()
    if geom.base < storage or geom.base - storage + geom.extent() > nbytes:
        raise PoolError("block_geometry: the blocks reach outside the tensors' storage")
    return geom


def _check_disjoint(g: BlockGeometry) -> None:
    """No two bytes of two runs or two blocks overlap: the runs of a block nest inside one block
    stride, or the blocks nest inside one run stride."""
    if g.runs > 1 and g.run_stride < g.run_nbytes:
        raise PoolError(f"block_geometry: runs of {g.run_nbytes} bytes overlap (run stride {g.run_stride})")
    if g.num_blocks > 1 and g.block_stride < g.run_nbytes:
        raise PoolError(
            f"block_geometry: blocks of {g.run_nbytes} bytes overlap (block stride {g.block_stride})"
        )
    runs_in_block = g.num_blocks == 1 or (g.runs - 1) * g.run_stride + g.run_nbytes <= g.block_stride
    blocks_in_run = g.runs == 1 or (g.num_blocks - 1) * g.block_stride + g.run_nbytes <= g.run_stride
    if not (runs_in_block or blocks_in_run):
        raise PoolError(
            f"block_geometry: {g.runs} runs of stride {g.run_stride} bytes interleave with "
            f"{g.num_blocks} blocks of stride {g.block_stride}; one component cannot view them"
        )


class ExternalPool(HostPool):
    """A host pool whose one component is a zero-copy view of memory the caller owns.

    It never allocates and cannot be re-bound. Build it with :meth:`from_block_tensors` (an
    engine's per-layer KV tensors) or directly from a :class:`BlockGeometry` and the tensor that
    holds it. The caller must keep that memory alive as long as the pool is used.
    """

    def __init__(
        self,
        geometry: BlockGeometry,
        holder: torch.Tensor,
        *,
        page_size: int,
        component: str = "kv",
        hit_policy: HitPolicy = HitPolicy.ALL_PAGES,
        rank_replicated: bool = False,
    ) -> None:
        if not isinstance(geometry, BlockGeometry):
            raise ArgumentTypeError(
                f"ExternalPool: geometry must be a BlockGeometry, got {type(geometry).__name__}"
            )
        if not isinstance(holder, torch.Tensor):
            raise ArgumentTypeError(
                f"ExternalPool: holder must be a torch.Tensor, got {type(holder).__name__}"
            )
        check_name(component, "ExternalPool: component")
        page_size = as_int(page_size, "ExternalPool: page_size", 1)
        flat = torch.empty(0, dtype=torch.uint8).set_(holder.untyped_storage())
        offset = geometry.base - flat.data_ptr()
        if offset < 0 or offset + geometry.extent() > flat.numel():
            raise PoolError("ExternalPool: the geometry reaches outside the holder tensor's storage")
        g = geometry
        if g.page_first:
            view = flat.as_strided(
                (g.num_blocks, g.runs, g.run_nbytes), (g.block_stride, g.run_nbytes, 1), offset
            )
            layout = Layout.PAGE_FIRST
        else:
            view = flat.as_strided(
                (g.runs, g.num_blocks, g.run_nbytes), (g.run_stride, g.block_stride, 1), offset
            )
            layout = Layout.LAYER_FIRST
        spec = ComponentSpec(component, g.runs, (g.run_nbytes,), torch.uint8)
        super().__init__([spec], g.num_blocks, layout=layout, page_size=page_size, allocate=False)
        self.hit_policy = HitPolicy(hit_policy)
        self.rank_replicated = bool(rank_replicated)
        self.geometry = g
        self._holder = holder  # keeps the storage alive with the pool
        self._buffers = (view,)

    @classmethod
    def from_block_tensors(
        cls,
        tensors: Sequence[torch.Tensor],
        *,
        page_size: int,
        component: str = "kv",
        hit_policy: HitPolicy = HitPolicy.ALL_PAGES,
        rank_replicated: bool = False,
    ) -> ExternalPool:
        """A pool viewing per-layer block tensors (dim 0 = block) in place; see the module docstring.

        ``page_size`` is the number of tokens in one block. Page ``i`` of the pool is block ``i``
        of every layer.
        """
        geometry = block_geometry(tensors)
        return cls(
            geometry,
            tensors[0],
            page_size=page_size,
            component=component,
            hit_policy=hit_policy,
            rank_replicated=rank_replicated,
        )

    def allocate(self, allocator: Any = None) -> None:
        raise PoolError("ExternalPool views memory its caller owns; it never allocates")

    def bind(self, memory: torch.Tensor) -> None:
        raise PoolError("ExternalPool is bound to its caller's memory at construction")
