"""Host pools: page-addressed CPU tensors (KV, Mamba, indexer, draft), their group and sizing."""

from .group import HostPoolGroup
from .host import (
    ComponentSpec,
    HostPool,
    IndexerPool,
    MambaPool,
    MHAKVPool,
    MLAKVPool,
    check_region,
    torch_allocator,
)

__all__ = [
    "ComponentSpec",
    "HostPool",
    "HostPoolGroup",
    "IndexerPool",
    "MHAKVPool",
    "MLAKVPool",
    "MambaPool",
    "check_region",
    "torch_allocator",
]
