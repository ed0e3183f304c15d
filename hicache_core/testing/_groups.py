"""The named test groups of the conformance suite (stable public API, import-light).

A test belongs to the group named by the first word after ``test_`` in its function name:
``test_v1_roundtrip[mha-13]`` is in group ``v1``. ``hicache check`` summarises results per
group and CONTRIBUTING.md lists every test by group.
"""

from __future__ import annotations

import re

__all__ = ["GROUPS", "group_of"]

GROUPS: dict[str, str] = {
    "discovery": "the entry point resolves to the backend class; distribution metadata matches; closed stores leave no threads or fds",
    "contract": "Options forbids extras; capabilities well-formed; draft hook matches draft_io; safe keys",
    "v1": "hicache_batch_io_v1 exists/get/set for MHA (2 components) and MLA (1); 0/1/13/300 pages",
    "v2": "hicache_batch_io_v2 for KV, KV+MAMBA (trailing pages), KV+INDEXER (all pages), DRAFT; misses",
    "pools": "every pool kind on both layouts; v1 and v2 read each other's pages; multi-pool backup/query/prefetch; store-allocated; re-registration",
    "batch": "results stay positional: keys, pages and transfers out of order or repeated, every pool",
    "draft": "draft KV offload through the declared draft_io mode",
    "prefix": "exists reports each page; a hole ends the restorable prefix",
    "idempotent": "re-setting a page keeps its bytes; never a mix of old and new",
    "partial": "per-page results when only some pages (or one component of a page) are stored",
    "isolation": "tp ranks (MHA), shared MLA ranks, model / dtype / layout / pp / cp / pool / draft; custom keys",
    "bytes": "exact bytes after get (zero pages too); a get writes only its target slots (canaries in every pool); set and exists never write host memory, nothing does after a call returns",
    "clear": "hicache_clear removes only its namespace, every pool, whoever wrote it; nothing is served after it",
    "persistence": "every pool survives close + reopen, and a writer killed without close (capabilities.persistent)",
    "shared": "data is visible to other stores and processes; concurrent ranks lose nothing (capabilities.shared)",
    "concurrency": "threads writing (distinct bytes) and reading the same pages; no torn pages",
    "errors": "bad input raises typed hicache errors; hostile keys, symlinks and model names stay inside storage",
    "stateful": "a hypothesis state machine compared with a dict model",
}

_NAME_RE = re.compile(r"test_([a-z0-9]+)")


def group_of(test_name: str) -> str:
    """The group of a test function or node name (``"other"`` if it is not a suite test)."""
    base = test_name.rsplit("::", 1)[-1].split("[", 1)[0]
    m = _NAME_RE.match(base)
    if m is None or m.group(1) not in GROUPS:
        return "other"
    return m.group(1)
