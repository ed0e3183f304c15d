"""Canaries: every ``get`` the suite makes is checked for bytes written outside its target slots.

:class:`CanaryGuard` is a plugin the suite registers in the ``PluginManager`` of every store it
opens. It wraps both I/O hooks (``wrapper=True``, so it sees every call, the controller's and the
suite's own). Around a ``get`` it writes a seeded pattern into every byte of every registered pool
that the call does not target (around and between the target pages, in every pool and
component), lets the call run, compares, and puts the original bytes back. A mismatch is
recorded in the shared :class:`CanaryState` (never raised inside the hook: the store would turn it
into a per-page failure) and reported by the suite's helpers (``hc.raw``, ``hc.matches``) and at
teardown.

Targets: on v2, every component of the pages named by each ``PoolTransfer``'s host indices; on
v1, the pool pages the call's buffers are views of (per component: a v1 ``get`` of a page's ``k``
key must not write its ``v``). A buffer outside every pool (a staging buffer) targets nothing.

While armed, every I/O call of every guarded store is serialised under one lock, so another
call can never see (or publish) the pattern; tests that run I/O from several threads on purpose
turn the canaries off (``CanaryState.enabled``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any

import torch

from hicache_core import HostPool, IoOp, Layout, PoolName, PoolTransfer, hookimpl

__all__ = ["CanaryGuard", "CanaryState"]

_SEED = 0x5EED_CA9A


class CanaryState:
    """What the guards of one test share: on/off, the lock, and the violations found."""

    def __init__(self) -> None:
        self.enabled = True
        self.lock = threading.RLock()
        self.violations: list[str] = []
        self._reported = 0

    def take_new(self) -> list[str]:
        """Violations recorded since the last call."""
        with self.lock:
            new = self.violations[self._reported :]
            self._reported = len(self.violations)
        return new

    def check(self) -> None:
        """Raise ``AssertionError`` naming every violation not reported yet."""
        new = self.take_new()
        if new:
            raise AssertionError(
                "a get wrote host memory outside its target slots (it may only write the pages it "
                "was asked for, and only until it returns: a write made after an earlier call "
                "returned is reported against the call running then): "
                + "; ".join(new[:6])
                + (f" (+{len(new) - 6} more)" if len(new) > 6 else "")
            )


class _Armed:
    """One buffer whose non-target pages hold the pattern during a call."""

    __slots__ = ("buf", "comp", "idx", "pattern", "pd", "pool", "saved", "targets")

    def __init__(
        self, pool: str, comp: str, buf: torch.Tensor, pd: int, targets: set[int], pattern_of: Any
    ) -> None:
        self.pool, self.comp, self.buf, self.pd, self.targets = pool, comp, buf, pd, targets
        num_pages = buf.shape[pd]
        non = [i for i in range(num_pages) if i not in targets]
        self.idx = torch.tensor(non, dtype=torch.long)
        self.saved = buf.index_select(pd, self.idx)
        self.pattern = pattern_of(tuple(self.saved.shape))
        buf.index_copy_(pd, self.idx, self.pattern)

    def stray_pages(self) -> list[int]:
        """Non-target pages whose bytes changed during the call."""
        diff = self.buf.index_select(self.pd, self.idx) != self.pattern
        per_page = diff.transpose(0, self.pd).reshape(len(self.idx), -1).any(1)
        return [int(self.idx[j]) for j in per_page.nonzero().flatten().tolist()]

    def restore(self) -> None:
        self.buf.index_copy_(self.pd, self.idx, self.saved)


def _page_dim(pool: HostPool) -> int:
    return 0 if pool.layout is Layout.PAGE_FIRST else 1


class CanaryGuard:
    """Wraps ``hicache_batch_io_v1`` / ``_v2`` of one store (see the module docstring).

    ``pools`` returns the pools registered with the store right now (``Store.pools``).
    """

    def __init__(self, state: CanaryState, pools: Callable[[], Mapping[PoolName, HostPool]]) -> None:
        self.state = state
        self.pools = pools
        self._patterns: dict[tuple[int, ...], torch.Tensor] = {}

    # ------------------------------------------------------------------ hooks
    @hookimpl(wrapper=True)
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> Generator[None, Any, Any]:
        if not self.state.enabled:
            return (yield)
        with self.state.lock:
            if _op(op) is not IoOp.GET or not buffers:
                return (yield)
            targets = self._v1_targets(buffers)
            return (yield from self._guarded(targets, f"hicache_batch_io_v1(get, {len(keys)} keys)"))

    @hookimpl(wrapper=True)
    def hicache_batch_io_v2(self, op: IoOp, transfers: Sequence[PoolTransfer]) -> Generator[None, Any, Any]:
        if not self.state.enabled:
            return (yield)
        with self.state.lock:
            if _op(op) is not IoOp.GET or not transfers:
                return (yield)
            targets = self._v2_targets(transfers)
            what = ", ".join(f"{_name(t.pool)}{list(t.host_indices)[:8]}" for t in transfers)
            return (yield from self._guarded(targets, f"hicache_batch_io_v2(get, {what})"))

    # ---------------------------------------------------------------- helpers
    def _buffers(self) -> Iterable[tuple[str, HostPool, int, torch.Tensor]]:
        seen: set[int] = set()
        for name, pool in list(self.pools().items()):
            if not pool.allocated:
                continue
            for ci, buf in enumerate(pool.buffers()):
                if buf.numel() and buf.data_ptr() not in seen:
                    seen.add(buf.data_ptr())
                    yield _name(name), pool, ci, buf

    def _v1_targets(self, buffers: Sequence[torch.Tensor]) -> dict[int, set[int]]:
        spans = [
            (buf.data_ptr(), buf.data_ptr() + buf.numel(), buf.stride(_page_dim(pool)))
            for _, pool, _, buf in self._buffers()
        ]
        out: dict[int, set[int]] = {}
        for view in buffers:
            if not isinstance(view, torch.Tensor) or view.numel() == 0:
                continue
            ptr = view.data_ptr()
            for start, stop, stride in spans:
                if start <= ptr < stop:
                    out.setdefault(start, set()).add((ptr - start) // stride)
                    break
        return out

    def _v2_targets(self, transfers: Sequence[PoolTransfer]) -> dict[int, set[int]]:
        pools = self.pools()
        out: dict[int, set[int]] = {}
        for t in transfers:
            pool = pools.get(t.pool)
            if pool is None or not pool.allocated:
                continue
            for buf in pool.buffers():
                out.setdefault(buf.data_ptr(), set()).update(int(i) for i in t.host_indices)
        return out

    def _pattern(self, shape: tuple[int, ...]) -> torch.Tensor:
        pattern = self._patterns.get(shape)
        if pattern is None:
            gen = torch.Generator().manual_seed(_SEED + sum(shape) * 131 + len(shape))
            pattern = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            if len(self._patterns) > 64:
                self._patterns.clear()
            self._patterns[shape] = pattern
        return pattern

    def _guarded(self, targets: dict[int, set[int]], what: str) -> Generator[None, Any, Any]:
        armed: list[_Armed] = []
        try:
            for name, pool, ci, buf in self._buffers():
                tgt = targets.get(buf.data_ptr(), set())
                if len(tgt) < pool.num_pages:
                    comp = pool.components[ci]
                    armed.append(_Armed(name, comp, buf, _page_dim(pool), tgt, self._pattern))
            return (yield)
        finally:
            for a in armed:
                stray = a.stray_pages()
                if stray:
                    self.state.violations.append(
                        f"{what} wrote host page(s) {stray[:12]} of pool {a.pool!r} component {a.comp!r}, "
                        f"outside its target slots {sorted(a.targets)[:12]}"
                    )
                a.restore()


def _op(op: object) -> IoOp | None:
    try:
        return IoOp(op)
    except ValueError:
        return None


def _name(pool: object) -> str:
    return str(getattr(pool, "value", pool))
