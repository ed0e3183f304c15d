"""Sizing helpers (design.md section 6), public as ``hicache_core.sizing``; defined in :mod:`hicache_core.pools`."""

from .pools.sizing import decode_mamba_pool_size, standalone_required_bytes

__all__ = ["decode_mamba_pool_size", "standalone_required_bytes"]
