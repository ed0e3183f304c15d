"""Deterministic page contents and page hashes, and byte-exact verification.

Every component buffer of every pool is filled from its own ``torch.Generator`` seeded from
``(seed, pool, component)``, in fixed-size chunks. The verifier (a fresh process) regenerates the
same bytes chunk by chunk and compares them with what a prefetch wrote into zeroed pools, so
every byte is checked without keeping a second copy of the pools in memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..paging import page_hashes
from ..pools import HostPoolGroup
from ..types import PoolName
from .profiles import Request

__all__ = ["CHUNK_BYTES", "Mismatch", "VerifyReport", "fill_pools", "request_hashes", "verify_pools"]

CHUNK_BYTES = 16 << 20
"""Bytes generated per step (a multiple of 8); part of the byte stream's definition."""

VOCAB = 151_936
"""Token ids are drawn from ``[0, VOCAB)`` (a Qwen-sized vocabulary)."""


def _derive(seed: int, *parts: str) -> int:
    digest = hashlib.sha256(":".join((str(seed), *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _stream(seed: int, pool: str, component: str, nbytes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(offset, uint8 chunk)`` pairs covering ``nbytes`` random bytes."""
    gen = torch.Generator().manual_seed(_derive(seed, pool, component))
    scratch = torch.empty(min(nbytes, CHUNK_BYTES) // 8 + 1, dtype=torch.int64)
    for off in range(0, nbytes, CHUNK_BYTES):
        n = min(CHUNK_BYTES, nbytes - off)
        words = scratch[: (n + 7) // 8]
        words.random_(-(1 << 63), None, generator=gen)
        yield off, words.view(torch.uint8)[:n]


def _components(group: HostPoolGroup, pools: Iterable[PoolName]) -> Iterator[tuple[str, str, torch.Tensor]]:
    for name in pools:
        pool = group[name]
        for comp, buf in zip(pool.components, pool.buffers()):
            yield name.value, comp, buf


def fill_pools(group: HostPoolGroup, seed: int, pools: Iterable[PoolName] | None = None) -> int:
    """Fill every component buffer of ``pools`` (default: all) with seeded random bytes."""
    total = 0
    for pool, comp, buf in _components(group, pools if pools is not None else list(group)):
        flat = buf.view(-1)
        for off, chunk in _stream(seed, pool, comp, flat.numel()):
            flat[off : off + chunk.numel()].copy_(chunk)
        total += flat.numel()
    return total


@dataclass(frozen=True)
class Mismatch:
    """Pages (slots) of one component whose bytes differ from what was backed up."""

    pool: str
    component: str
    bad_pages: int
    first_pages: tuple[int, ...]

    def __str__(self) -> str:
        first = ", ".join(map(str, self.first_pages))
        return f"{self.pool}.{self.component}: {self.bad_pages} page(s) differ (first: {first})"


@dataclass
class VerifyReport:
    """Bytes compared and the components that differed."""

    bytes_checked: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def verify_pools(group: HostPoolGroup, seed: int, pools: Iterable[PoolName]) -> VerifyReport:
    """Compare every byte of ``pools`` against the seeded stream :func:`fill_pools` wrote."""
    report = VerifyReport()
    for pool, comp, buf in _components(group, pools):
        flat = buf.view(-1)
        page_bytes = flat.numel() // buf.shape[0]
        bad: set[int] = set()
        for off, expected in _stream(seed, pool, comp, flat.numel()):
            got = flat[off : off + expected.numel()]
            if not torch.equal(got, expected):
                where = (got != expected).nonzero().view(-1) + off
                bad.update((where // page_bytes).tolist())
        report.bytes_checked += flat.numel()
        if bad:
            report.mismatches.append(Mismatch(pool, comp, len(bad), tuple(sorted(bad)[:5])))
    return report


def request_hashes(seed: int, reqs: Iterable[Request], page_tokens: int, round: int = 0) -> list[list[str]]:
    """Chained page hashes of each request's random token sequence (one chain per request).

    Each ``round`` draws new tokens, so a repeated backup writes fresh keys.
    """
    out = []
    for r in reqs:
        gen = torch.Generator().manual_seed(_derive(seed, "tokens", str(round), str(r.index)))
        tokens = torch.randint(0, VOCAB, (r.pages * page_tokens,), dtype=torch.int32, generator=gen)
        out.append(page_hashes(tokens, page_tokens))
    return out
