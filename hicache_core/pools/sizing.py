"""Sizing helpers: the standalone shared-mapping size and Mamba slots on a PD decode node."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ArgumentTypeError, ConfigError, PoolError

__all__ = ["decode_mamba_pool_size", "standalone_required_bytes"]

log = logging.getLogger("hicache")

# Attributes of SGLang-style pools that hold hybrid buffers, tried when a pool has no buffers().
_HYBRID_ATTRS = ("kv_buffer", "k_buffer", "v_buffer", "temporal", "conv", "index_k_buffer", "buffer")


def _pool_buffers(name: str, pool: Any) -> list[Any]:
    if pool is None:
        raise PoolError(
            f"standalone sizing: pool {name!r} is missing (None); register every pool that will be "
            "offloaded before sizing the shared mapping"
        )
    buffers = getattr(pool, "buffers", None)
    if callable(buffers):
        if not getattr(pool, "allocated", True):
            return [("planned", pool.nbytes)]
        found = buffers()
        if not isinstance(found, Iterable) or isinstance(found, (str, bytes)):
            raise ArgumentTypeError(
                f"standalone sizing: pool {name!r}: buffers() must return its torch tensors, "
                f"got {type(found).__name__}"
            )
        out = list(found)
    else:
        getter = getattr(pool, "get_hybrid_pool_buffer", None)
        if callable(getter):
            found = getter()
        else:
            found = [getattr(pool, a) for a in _HYBRID_ATTRS if getattr(pool, a, None) is not None]
        out = []
        for b in found if isinstance(found, (list, tuple)) else [found]:
            out.extend(b if isinstance(b, (list, tuple)) else [b])
    for buf in out:
        if not all(callable(getattr(buf, a, None)) for a in ("data_ptr", "numel", "element_size", "stride")):
            raise ArgumentTypeError(
                f"standalone sizing: pool {name!r} has a buffer of type {type(buf).__name__}; its "
                "buffers must be torch tensors (host memory the store maps)"
            )
    if not out:
        raise PoolError(
            f"standalone sizing: pool {name!r} ({type(pool).__name__}) exposes no buffers; give it a "
            "buffers() method returning its torch tensors"
        )
    return out


def standalone_required_bytes(pools: Any) -> int:
    """Bytes the standalone Mooncake client must map for these host pools.

    The bytes covered by the KV anchor's and every pool's hybrid buffers (Mamba temporal and conv,
    DSA indexer, draft KV), each byte counted once: buffers that are views of one another (SGLang's
    ``k_buffer``/``v_buffer`` inside ``kv_buffer``, a pool shared by two names) overlap. ``pools`` is a
    :class:`~hicache_core.HostPoolGroup`, a mapping ``name -> pool`` (which must hold ``"kv"``),
    or a single pool. Planned (unallocated) pools count their planned size: the region
    ``allocate()`` will take, each component rounded up to 64 bytes (the design's 128 + 64 + 32
    example gives 224 allocated, 256 planned), since that region is what the mapping must hold. A missing pool, or
    one without buffers, raises :class:`~hicache_core.PoolError`; a buffer that is not a tensor
    raises :class:`~hicache_core.ArgumentTypeError` naming the pool.
    """
    if isinstance(pools, Mapping):
        items = [(str(getattr(k, "value", k)), v) for k, v in pools.items()]
        if "kv" not in {n for n, _ in items}:
            raise PoolError(
                f"standalone sizing needs the KV anchor pool under 'kv'; got pools {[n for n, _ in items]}"
            )
    elif isinstance(pools, Iterable) and not hasattr(pools, "buffers"):
        items = [(f"pool[{i}]", p) for i, p in enumerate(pools)]
    else:
        items = [("kv", pools)]
    total = 0
    spans: list[tuple[int, int]] = []  # [start, end) of every tensor's memory
    for name, pool in items:
        for buf in _pool_buffers(name, pool):
            if isinstance(buf, tuple) and buf[0] == "planned":
                total += int(buf[1])
                continue
            if int(buf.numel()) == 0:
                continue
            start, size = int(buf.data_ptr()), int(buf.element_size())
            last = sum((n - 1) * st for n, st in zip(buf.shape, buf.stride()))  # furthest element
            spans.append((start, start + (last + 1) * size))
    end = -1
    for start, stop in sorted(spans):  # the union of the spans
        total += max(0, stop - max(start, end))
        end = max(end, stop)
    return total


def decode_mamba_pool_size(
    size: int,
    pre_alloc_size: int,
    mamba_size: int | None = None,
    *,
    extra_buffer: bool,
    overlap_schedule: bool,
) -> int:
    """Mamba slots a PD decode node needs (SGLang PR 22462).

    ``slots_per_req = 1 + (ping_pong if extra_buffer else 0)`` with ``ping_pong = 2`` under the
    overlap schedule, else 1; ``needed = (size + pre_alloc_size) * slots_per_req``. Returns
    ``max(mamba_size, needed)`` (``needed`` when ``mamba_size`` is None) and logs one warning with
    both numbers when it raises ``mamba_size``. Negative inputs raise :class:`ConfigError`; a flag
    that is not a ``bool`` raises :class:`ArgumentTypeError`.
    """
    for flag, given in (("extra_buffer", extra_buffer), ("overlap_schedule", overlap_schedule)):
        if not isinstance(given, bool):
            raise ArgumentTypeError(f"decode_mamba_pool_size: {flag} must be True or False, got {given!r}")
    for label, value in (("size", size), ("pre_alloc_size", pre_alloc_size), ("mamba_size", mamba_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ConfigError(f"decode_mamba_pool_size: {label} must be a non-negative int, got {value!r}")
    ping_pong = 2 if overlap_schedule else 1
    slots_per_req = 1 + (ping_pong if extra_buffer else 0)
    needed = (size + pre_alloc_size) * slots_per_req
    if mamba_size is None:
        return needed
    if needed > mamba_size:
        log.warning(
            "hicache: raising the Mamba pool from %d to %d slots for a PD decode node "
            "((size %d + pre_alloc %d) x %d slots per request)",
            mamba_size,
            needed,
            size,
            pre_alloc_size,
            slots_per_req,
        )
        return needed
    return mamba_size
