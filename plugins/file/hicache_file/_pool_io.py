"""Buffer lists (iovecs) for page components, straight over host-pool memory.

``os.writev`` / ``os.readv`` take a list of buffers, so a page component is moved without an
intermediate copy in both layouts:

* ``page_first``: one contiguous slice of the component buffer per page;
* ``layer_first``: one slice per layer (the page is strided), gathered/scattered by the
  kernel; the checksum streams over the same slices.

Only when a view cannot be expressed as at most ``MAX_IOV`` contiguous runs (an unusual
custom pool, or more layers than the kernel's ``IOV_MAX``) does a page go through one
scratch copy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hicache_core import BatchShapeError, Layout

if TYPE_CHECKING:  # torch loads on first I/O, so listing backends stays fast
    import torch

    from hicache_core import HostPool

__all__ = ["MAX_IOV", "PoolIo", "Post", "tensor_iov"]

try:
    MAX_IOV = min(int(os.sysconf("SC_IOV_MAX")), 1024) - 2  # header + spare byte
except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
    MAX_IOV = 14

Post = tuple["torch.Tensor", "torch.Tensor"]
"""``(destination view, scratch)``: after a successful read, copy scratch into the view."""


def tensor_iov(t: Any, for_read: bool) -> tuple[list[Any], Post | None]:
    """Buffers covering the bytes of uint8 CPU tensor ``t`` in logical (row-major) order.

    Contiguous -> one buffer; 2-D with contiguous rows (a ``layer_first`` page view) -> one
    buffer per row; anything else -> a scratch copy (for reads, ``Post`` says where to copy
    it afterwards). Raises :class:`BatchShapeError` for a non-tensor, a non-uint8 dtype or a
    non-CPU device.
    """
    import torch

    if not isinstance(t, torch.Tensor):
        raise BatchShapeError(f"buffers must be torch.uint8 CPU tensors, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.device.type != "cpu":
        raise BatchShapeError(
            f"buffers must be torch.uint8 CPU tensors (page-component views of a host pool), "
            f"got dtype={t.dtype} device={t.device}"
        )
    if t.is_contiguous():
        return [t.reshape(-1).numpy()], None
    if t.dim() == 2 and t.stride(1) == 1 and 0 < t.shape[0] <= MAX_IOV:
        return list(t.numpy()), None
    if for_read:
        scratch = torch.empty(t.numel(), dtype=torch.uint8)
        return [scratch.numpy()], (t, scratch)
    return [t.contiguous().reshape(-1).numpy()], None


class PoolIo:
    """A registered pool plus cached flat views of its component buffers."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.sizes: tuple[int, ...] = tuple(pool.component_nbytes)
        self.ncomp = len(self.sizes)
        self._src: tuple[torch.Tensor, ...] | None = None
        self._mode = "generic"
        self._flat: list[tuple[memoryview, int, int, int]] = []

    def _prepare(self, bufs: tuple[torch.Tensor, ...]) -> None:
        import torch

        self._src = bufs
        self._mode = "generic"
        self._flat = []
        layout = self.pool.layout
        flat = []
        for b, size in zip(bufs, self.sizes):
            ok = (
                isinstance(b, torch.Tensor)
                and b.dtype == torch.uint8
                and b.device.type == "cpu"
                and b.dim() == 3
                and b.is_contiguous()
            )
            if not ok:
                return
            mv = b.numpy().data.cast("B")
            if layout is Layout.PAGE_FIRST:
                if b.shape[0] != self.pool.num_pages or b.shape[1] * b.shape[2] != size:
                    return
                flat.append((mv, size, 0, 0))
            else:
                layers, pages, per_layer = b.shape
                if (
                    pages != self.pool.num_pages
                    or layers * per_layer != size
                    or not 0 < per_layer
                    or layers > MAX_IOV
                ):
                    return
                flat.append((mv, per_layer, pages * per_layer, layers))
        self._flat = flat
        self._mode = layout.value

    def iovs(self, slots: Sequence[int], for_read: bool) -> tuple[list[list[Any]], list[Post | None] | None]:
        """Per page (in ``slots`` order), per component: the buffers to write from / read into.

        Returns ``(iovs, posts)``; ``posts`` is ``None`` unless some component needs a scratch
        copy after a read. Slots are range-checked (:class:`BatchShapeError`).
        """
        idx = self.pool.check_indices(slots)
        bufs = self.pool.buffers()
        if bufs is not self._src:
            self._prepare(bufs)
        out: list[list[Any]] = []
        if self._mode == "page_first":
            for i in idx:
                for mv, size, _, _ in self._flat:
                    start = i * size
                    out.append([mv[start : start + size]])
            return out, None
        if self._mode == "layer_first":
            for i in idx:
                for mv, per_layer, stride, layers in self._flat:
                    start = i * per_layer
                    out.append([mv[o : o + per_layer] for o in range(start, start + layers * stride, stride)])
            return out, None
        posts: list[Post | None] = []
        for views in self.pool.page_views(idx):
            for v in views:
                iov, post = tensor_iov(v, for_read)
                out.append(iov)
                posts.append(post)
        return out, (posts if any(p is not None for p in posts) else None)
