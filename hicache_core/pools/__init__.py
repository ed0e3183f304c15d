"""Host pools: page-addressed CPU tensors (KV, Mamba, indexer, draft), views of an engine's own
memory (``ExternalPool``), their group and sizing."""

from .external import BlockGeometry, ExternalPool, block_geometry
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
    "BlockGeometry",
    "ComponentSpec",
    "ExternalPool",
    "HostPool",
    "HostPoolGroup",
    "IndexerPool",
    "MHAKVPool",
    "MLAKVPool",
    "MambaPool",
    "block_geometry",
    "check_region",
    "torch_allocator",
]
