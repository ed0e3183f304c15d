"""Model profiles of ``hicache bench`` and the layout of its workload.

A profile holds the *per-rank* host-pool geometry of a real model at a typical tensor-parallel
degree (layers, heads, head dims, dtypes, Mamba state, DSA indexer, draft/MTP layers), with a
page size (tokens per page) chosen so one page is a few hundred KiB: realistic objects for a
storage backend while the default run stays small enough for a 2-core CPU machine.

The workload is ``pages`` KV pages split into requests of :data:`REQUEST_PAGES` pages. Each
request is one token sequence (its own page-hash chain), occupies a contiguous run of KV host
pages and, for hybrid models, owns one Mamba slot holding the state after its last page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..pools import HostPool, HostPoolGroup, IndexerPool, MambaPool, MHAKVPool, MLAKVPool
from ..types import Layout, PoolName

__all__ = [
    "PROFILES",
    "REQUEST_PAGES",
    "IndexerShape",
    "KVShape",
    "MambaShape",
    "ModelProfile",
    "Request",
    "build_pools",
    "config_fields",
    "requests",
]

REQUEST_PAGES = 128
"""Pages per request: one controller batch at the default ``batch_pages``."""


@dataclass(frozen=True)
class KVShape:
    """A KV pool: MHA (K and V, ``heads`` x ``head_dim`` each) or MLA (one latent of ``head_dim``)."""

    kind: Literal["mha", "mla"]
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def build(self, num_pages: int, page_tokens: int) -> HostPool:
        if self.kind == "mha":
            return MHAKVPool(
                num_pages, page_tokens, self.layers, self.heads, self.head_dim, self.dtype, allocate=False
            )
        return MLAKVPool(num_pages, page_tokens, self.layers, self.head_dim, self.dtype, allocate=False)

    def describe(self) -> str:
        if self.kind == "mha":
            return f"MHA {self.layers} layers x {self.heads} KV heads x {self.head_dim}"
        return f"MLA {self.layers} layers x {self.head_dim} latent"


@dataclass(frozen=True)
class MambaShape:
    """Linear-attention (Mamba / Gated DeltaNet) state of one request, per layer."""

    layers: int
    temporal: tuple[int, ...]
    conv: tuple[tuple[int, ...], ...]
    temporal_dtype: torch.dtype = torch.float32
    conv_dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class IndexerShape:
    """DSA (NSA) indexer keys: ``dim`` bytes per token per layer (fp8 key + fp32 scale)."""

    layers: int
    dim: int


@dataclass(frozen=True)
class ModelProfile:
    """Per-rank pool geometry of one model (see the module docstring)."""

    name: str
    summary: str
    kv: KVShape
    draft: KVShape
    page_tokens: int
    tp_size: int = 1
    mamba: MambaShape | None = None
    indexer: IndexerShape | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv.kind == "mla"

    def describe(self) -> str:
        parts = [self.kv.describe()]
        if self.mamba is not None:
            parts.append(f"Mamba {self.mamba.layers} layers")
        if self.indexer is not None:
            parts.append(f"DSA indexer {self.indexer.layers} layers x {self.indexer.dim} B")
        return f"{', '.join(parts)}; {self.page_tokens} tokens/page, tp rank 0 of {self.tp_size}"


PROFILES: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile(
            "llama3-8b",
            "Llama 3 8B: MHA (GQA 8 KV heads), bf16; EAGLE3 draft (1 layer)",
            kv=KVShape("mha", 32, 8, 128),
            draft=KVShape("mha", 1, 8, 128),
            page_tokens=2,
        ),
        ModelProfile(
            "deepseek-v3",
            "DeepSeek-V3: MLA (512 latent + 64 rope), bf16, rank-replicated; MTP draft (1 layer)",
            kv=KVShape("mla", 61, 1, 576),
            draft=KVShape("mla", 1, 1, 576),
            page_tokens=4,
            tp_size=8,
        ),
        ModelProfile(
            "qwen3-next",
            "Qwen3-Next 80B-A3B at TP4: 12 full-attention layers + 36 Gated DeltaNet (Mamba) layers; "
            "MTP draft (1 layer)",
            kv=KVShape("mha", 12, 1, 256),
            draft=KVShape("mha", 1, 1, 256),
            page_tokens=16,
            tp_size=4,
            mamba=MambaShape(36, temporal=(8, 128, 128), conv=((2048, 3),)),
        ),
        ModelProfile(
            "deepseek-v3.2",
            "DeepSeek-V3.2: MLA + DSA indexer (128 fp8 + fp32 scale per token), rank-replicated; "
            "MTP draft (1 layer)",
            kv=KVShape("mla", 61, 1, 576),
            draft=KVShape("mla", 1, 1, 576),
            page_tokens=4,
            tp_size=8,
            indexer=IndexerShape(61, 132),
        ),
    )
}


@dataclass(frozen=True)
class Request:
    """One token sequence: KV host pages ``[start, stop)`` and (hybrid models) Mamba ``slot``."""

    index: int
    start: int
    stop: int

    @property
    def pages(self) -> int:
        return self.stop - self.start

    @property
    def kv_indices(self) -> list[int]:
        return list(range(self.start, self.stop))

    def extra(self, profile: ModelProfile) -> dict[PoolName | str, Any]:
        """Controller ``extra`` indices: the Mamba slot; sidecars default to the KV indices."""
        return {PoolName.MAMBA: [self.index]} if profile.mamba is not None else {}


def requests(pages: int, request_pages: int = REQUEST_PAGES) -> list[Request]:
    """Split ``pages`` KV pages into consecutive requests of at most ``request_pages``."""
    return [
        Request(i, start, min(start + request_pages, pages))
        for i, start in enumerate(range(0, pages, request_pages))
    ]


def build_pools(profile: ModelProfile, pages: int, draft: bool) -> HostPoolGroup:
    """Planned (unallocated) pools, so the controller takes their memory from the store."""
    kv = profile.kv.build(pages, profile.page_tokens)
    extras: dict[PoolName | str, HostPool] = {}
    if profile.mamba is not None:
        m = profile.mamba
        extras[PoolName.MAMBA] = MambaPool(
            len(requests(pages)),
            m.layers,
            m.temporal,
            m.conv,
            m.temporal_dtype,
            m.conv_dtype,
            layout=Layout.PAGE_FIRST,
            allocate=False,
        )
    if profile.indexer is not None:
        extras[PoolName.INDEXER] = IndexerPool(
            pages, profile.page_tokens, profile.indexer.layers, profile.indexer.dim, allocate=False
        )
    if draft:
        extras[PoolName.DRAFT] = profile.draft.build(pages, profile.page_tokens)
    return HostPoolGroup(kv, extras)


def config_fields(profile: ModelProfile) -> dict[str, Any]:
    """The :class:`~hicache_core.StorageConfig` fields that identify this model on rank 0."""
    return {
        "kv_dtype": str(profile.kv.dtype).removeprefix("torch."),
        "is_mla_model": profile.is_mla,
        "tp_rank": 0,
        "tp_size": profile.tp_size,
        "layout": Layout.PAGE_FIRST.value,
    }
