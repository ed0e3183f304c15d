"""The numbered rules of the backend contract, and the tag that ties a suite test to them.

:data:`RULES` is the one machine-readable copy of the rules that CONTRIBUTING.md ("The rules")
states in words; ``tests/conformance/test_rules.py`` checks that the two lists are equal, that
every rule has at least one test in the suite, and that every suite test names only rules that
exist. A suite test is tagged with :func:`rule` (the pytest marker ``hicache_rule``) and its
docstring quotes the sentence it checks. ``hicache check NAME --rules`` prints, per rule, its
tests and their result for the backend. Import-light: pytest loads only when a test is tagged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

__all__ = ["MARKER", "RULES", "Rule", "rule", "rules_of"]

MARKER = "hicache_rule"
"""The pytest marker carrying a test's rule ids: ``@pytest.mark.hicache_rule("R8", "R10")``."""


class Rule(NamedTuple):
    """One rule: its topic (a word or two) and the sentence CONTRIBUTING.md states."""

    topic: str
    text: str


RULES: dict[str, Rule] = {
    "R1": Rule(
        "registration",
        "The entry point named NAME in group `hicache.backends` resolves to the backend class, and the "
        "distribution's metadata and `hicache backends` agree with it.",
    ),
    "R2": Rule(
        "construction",
        "A backend is built once per opened store as `cls(config, options)`; `hicache_close` releases "
        "what it opened, and closing a store twice is harmless.",
    ),
    "R3": Rule(
        "options",
        '`Options` is a pydantic model with `extra="forbid"` and a default for every field: an unknown '
        "option is refused with an `OptionsError` naming the backend and the field.",
    ),
    "R4": Rule(
        "capabilities",
        "`capabilities` is a `Capabilities` that agrees with the hooks: `v1` and `v2` each need their I/O "
        "hook, `zero_copy` needs `v2`, `pools` contains `kv`; an instance may narrow its class's "
        "capabilities for its options, never widen them.",
    ),
    "R5": Rule(
        "register_pool",
        "`hicache_register_pool` runs for every pool before any I/O on it; registering a name again "
        "replaces the earlier pool, and later I/O never touches the earlier pool object.",
    ),
    "R6": Rule(
        "pools",
        "A backend stores every pool kind it declares in `capabilities.pools` (MHA KV, MLA KV, Mamba, "
        "indexer, draft), on both layouts (`page_first` and `layer_first`; only a `zero_copy` backend "
        "without `v1` may require `page_first`), on every I/O path it declares; a pool it does not "
        "declare is refused with `PoolError`.",
    ),
    "R7": Rule(
        "host memory",
        "Pools whose memory the store provides (`hicache_alloc_host_memory`, plain torch memory when it "
        "returns `None`) move pages like any other pool.",
    ),
    "R8": Rule(
        "positional results",
        "Results are positional: one bool per key (v1), one list per `PoolTransfer` with one bool per "
        "page (v2), and result `i` answers input `i` (for v2, `host_indices[i]` is the host slot of page "
        "`i`), whatever the order of the keys, pages and transfers, and when a key or page repeats in a "
        "GET or EXISTS batch.",
    ),
    "R9": Rule(
        "batch sizes",
        "Any batch size works: an empty batch returns `[]` (a transfer with no pages gets `[]` in its "
        "slot) without touching storage, and an I/O hook never returns `None` or anything but lists of "
        "bools.",
    ),
    "R10": Rule(
        "partial failure",
        "Partial failure is reported per entry: a key or page that is not stored is `False` for EXISTS "
        "and GET; an I/O hook raises only for a failure of the whole call.",
    ),
    "R11": Rule(
        "exact bytes",
        "GET `True` means the buffer now holds exactly the bytes of the last successful SET of that key, "
        "whatever their values, strided (`layer_first`) views included.",
    ),
    "R12": Rule(
        "get writes its targets only",
        "A GET writes nothing but its target buffers: not the other pages of the pool, not another pool.",
    ),
    "R13": Rule(
        "size mismatch",
        "A stored object whose size differs from the buffer (or from the registered pool's component) "
        "is a miss, never a partial copy.",
    ),
    "R14": Rule(
        "components",
        "A v2 page is `True` only when every one of its components is present, read or published; v1 "
        "answers each component key on its own.",
    ),
    "R15": Rule(
        "exists",
        "EXISTS `True` means present and readable: a GET of the same key right after it succeeds.",
    ),
    "R16": Rule(
        "raw facts",
        "A backend reports raw per-key or per-page facts; the controller applies hit policies, batching "
        "and skip-existing, so a backend never answers with a prefix count or a hit policy of its own.",
    ),
    "R17": Rule(
        "published",
        "SET `True` means the object is published: from then on EXISTS and GET of that key succeed until "
        "it is cleared (or evicted by a budget the operator configured).",
    ),
    "R18": Rule(
        "atomic set",
        "SET is atomic per key: a concurrent reader sees the key absent or the whole page, never a torn "
        "one, and concurrent writers leave one writer's bytes per component.",
    ),
    "R19": Rule(
        "re-set",
        "SET of a key that is already stored reports `True` and leaves either the stored object or the "
        "new one, whole.",
    ),
    "R20": Rule(
        "lent buffers",
        "Buffers are lent for the call only: a backend never keeps a reference to one or touches it "
        "after the hook returns (SET copies the bytes out).",
    ),
    "R21": Rule(
        "page keys",
        "`hicache_page_keys` returns one tuple per page hash with one key per component in "
        "`pool.components` order, keys file-name safe and distinct across pages, pools and components; "
        "`[]` for no hashes; an unregistered pool raises `PoolError`, a malformed hash `KeyFormatError`.",
    ),
    "R22": Rule(
        "identity",
        "Two configs that differ in model name, model revision, KV dtype, layout or (for per-rank pools) "
        "a tp, pp or attn-cp rank or size never share a page: neither sees nor overwrites the other's.",
    ),
    "R23": Rule(
        "rank-replicated pools",
        "Rank-replicated pools (MLA KV, the indexer) have one key for all ranks: rank 0 writes it and "
        "every rank reads the same page.",
    ),
    "R24": Rule(
        "pool key spaces",
        "Pages of one pool never satisfy or overwrite another pool's pages; draft pages live in their "
        "own key space.",
    ),
    "R25": Rule(
        "hostile keys",
        "An I/O hook refuses a key that is not a safe file name with a typed `HiCacheError` (or `False` "
        "for it), `hicache_clear` such a namespace with a typed `HiCacheError` (or by removing "
        "nothing), and nothing outside the backend's storage is created, read or changed.",
    ),
    "R26": Rule(
        "clear scope",
        '`hicache_clear(namespace)` removes every object whose key starts with `namespace + "."`: in '
        "every pool, whichever store or process wrote it; other namespaces keep their data; it returns "
        "how many objects it removed, as an `int`.",
    ),
    "R27": Rule(
        "after clear",
        "After a clear, no store on that storage reports or serves a cleared page (no cache may answer "
        "for it) until it is set again; then the new bytes are served.",
    ),
    "R28": Rule(
        "persistent",
        "`persistent`: the pages of every pool the backend declares survive closing the store and "
        "opening a new one on the same options.",
    ),
    "R29": Rule(
        "durable",
        "A `persistent` backend's SET is durable: a page reported `True` survives the process that wrote "
        "it ending without closing its store.",
    ),
    "R30": Rule(
        "shared",
        "`shared`: pages written by one store are visible, through exists, get, query and prefetch, to "
        "every other store opened on the same options, in this process or another, while both are "
        "open, both ways.",
    ),
    "R31": Rule(
        "concurrent processes",
        "Processes (such as the ranks of one model) that set pages on `shared` storage at the same time "
        "never lose each other's pages: every page any of them set is visible afterwards, and per-rank "
        "pages stay with their rank.",
    ),
    "R32": Rule(
        "set_skips_existing",
        "`set_skips_existing`: SET of a key that is already stored keeps the stored object, reports "
        "`True` and moves no bytes for it, for every options value that leaves the flag declared.",
    ),
    "R33": Rule(
        "zero_copy",
        "`zero_copy` needs `v2`: only such a backend may move bytes at the pools' `page_meta` addresses "
        "and require `page_first` pools; a `v2` backend without it also works on `layer_first` pools.",
    ),
    "R34": Rule(
        "draft capability",
        "`hicache_draft_io_capability` never returns `None`: under a default config it returns the "
        "declared `draft_io`, `unsupported` comes with a reason, and `should_split_heads=True` never gets "
        "`zero_copy_v2`.",
    ),
    "R35": Rule(
        "draft modes",
        "The declared `draft_io` mode is honoured: `generic` (needs `v1` and `draft` in `pools`) moves "
        "draft pages over v1 under their own keys, `zero_copy_v2` (needs `v2` and `draft` in `pools`) "
        "moves the draft pool's pages over v2 alongside the target pages, both byte-exact with the target "
        "pages they accompany; with `unsupported` the controller disables draft offload with one warning "
        "naming the backend.",
    ),
    "R36": Rule(
        "threads",
        "Hooks may be called from several threads at once: each call gets correct per-entry results and "
        "every page read holds one writer's bytes, whole.",
    ),
    "R37": Rule(
        "typed errors",
        "Bad input raises a typed `HiCacheError` naming the problem: `KeyFormatError` (malformed page "
        "hash), `BatchShapeError` (mismatched lengths, host pages out of range), `PoolError` "
        "(unregistered or undeclared pool), `BackendNotFoundError` (unknown backend).",
    ),
    "R38": Rule(
        "read-only source",
        "Host memory is read-only to SET and EXISTS: after either returns (and after a controller's "
        "backup) every host pool holds exactly the bytes it held before; a backend never writes, zeroes "
        "or reuses the pages it copies out.",
    ),
}

F = TypeVar("F", bound=Callable[..., Any])


def rule(*ids: str) -> Callable[[F], F]:
    """Tag a suite test with the rules it checks (the pytest marker :data:`MARKER`)."""
    import pytest

    return getattr(pytest.mark, MARKER)(*ids)  # type: ignore[no-any-return]


def rules_of(obj: Any) -> tuple[str, ...]:
    """The rule ids of a test function or a collected pytest item, in the order tagged."""
    marks: Iterable[Any]
    if hasattr(obj, "iter_markers"):
        marks = obj.iter_markers(MARKER)
    else:
        marks = [m for m in getattr(obj, "pytestmark", []) if getattr(m, "name", None) == MARKER]
    out: dict[str, None] = {}
    for mark in marks:
        out.update(dict.fromkeys(str(a) for a in mark.args))
    return tuple(out)
