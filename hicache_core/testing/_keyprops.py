"""Hypothesis strategies of ``test_isolation_custom_keys``: configs that differ in one identity field.

Each strategy draws ``(a, b, hashes, what)``: two sets of ``StorageConfig`` overrides that differ
only in the field under test (the other identity fields drawn at random, the same in both), page
hashes to key, and a description of the difference. The fields ``pool``, ``component``, ``draft``
and ``page_hash`` use one config (``a is b``): keys must differ inside it. Hypothesis is imported
only when a strategy is built (it is an optional dependency of the suite).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KEY_FIELDS", "RANK_FIELDS", "SLUG_ALIKE", "explicit_cases", "field_cases"]

KEY_FIELDS = (
    "model_name",
    "model_revision",
    "kv_dtype",
    "layout",
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "attn_cp_rank",
    "attn_cp_size",
    "pool",
    "component",
    "draft",
    "page_hash",
)
RANK_FIELDS = frozenset({"tp_rank", "tp_size"})
"""Fields along which rank-replicated pools (MLA KV, indexer) legitimately share keys."""

SLUG_ALIKE = (
    ("org/model-x", "org-model-x"),
    ("org/model.x", "org/model-x"),
    ("org/model_x", "org/model-x"),
    ("Org/Model-X", "org/model-x"),
    ("model x", "model-x"),
    ("org//model", "org/model"),
    ("m" * 60, "m" * 60 + "-x"),  # a slug cut at some length must not merge them
    ("модель", "model"),
)
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "fp8.e4m3", "fp8-e4m3", "int8")
REVISION_ALIKE = ((None, "main"), ("v1/x", "v1-x"), ("abc123", "ABC123"), ("a" * 40, "a" * 39 + "b"))
SIZES = (1, 2, 4, 8)
NAME_CHARS = "abcxyz0189-_./ "
HASH_CHARS = "0123456789abcdefABCDEF_-"


def _draw_base(draw: Any, st: Any) -> dict[str, Any]:
    """Random values for every identity field (used unchanged by both configs)."""
    base: dict[str, Any] = {
        "model_name": draw(st.text(NAME_CHARS, min_size=1, max_size=40).filter(lambda s: s.strip())),
        "kv_dtype": draw(st.sampled_from(DTYPES)),
        "layout": draw(st.sampled_from(("page_first", "layer_first"))),
    }
    for prefix in ("tp", "pp", "attn_cp"):
        size = draw(st.sampled_from(SIZES))
        base[f"{prefix}_size"] = size
        base[f"{prefix}_rank"] = draw(st.integers(0, size - 1))
    return base


def _mutate_name(draw: Any, st: Any, name: str) -> str:
    """A different name that a careless slug (separators to '-', lower case, cut) may merge with it."""
    i = draw(st.integers(0, len(name) - 1))
    choice = draw(st.sampled_from(("sep", "case", "append")))
    if choice == "case" and name.swapcase() != name:
        return str(name.swapcase())
    if choice == "append":
        return name + str(draw(st.sampled_from(("-", "_", ".", "/", "x"))))
    new = str(draw(st.sampled_from([c for c in "-_./ " if c != name[i]])))
    return name[:i] + new + name[i + 1 :]


def _hashes(draw: Any, st: Any, n_max: int = 3) -> list[str]:
    text = st.text(HASH_CHARS, min_size=1, max_size=64).map(lambda s: "a" + s)
    return list(draw(st.lists(text, min_size=1, max_size=n_max, unique=True)))


def field_cases(field: str) -> Any:
    """The strategy of ``(a, b, hashes, what)`` for ``field`` (one of :data:`KEY_FIELDS`)."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Any) -> tuple[dict[str, Any], dict[str, Any], list[str], str]:
        base = _draw_base(draw, st)
        a, b = dict(base), dict(base)
        hashes = _hashes(draw, st)
        if field == "model_name":
            if draw(st.booleans()):
                x, y = draw(st.sampled_from(SLUG_ALIKE))
            else:
                x = draw(st.text(NAME_CHARS, min_size=1, max_size=40).filter(lambda s: s.strip()))
                y = _mutate_name(draw, st, x)
            a["model_name"], b["model_name"] = x, (y if y != x else x + "-x")
        elif field == "model_revision":
            if draw(st.booleans()):
                x, y = draw(st.sampled_from(REVISION_ALIKE))
            else:
                x = draw(st.text("abcdef0123/-_.", min_size=1, max_size=40))
                y = _mutate_name(draw, st, x)
            a["model_revision"], b["model_revision"] = x, (y if y != x else x + "0")
        elif field == "kv_dtype":
            x, y = draw(st.lists(st.sampled_from(DTYPES), min_size=2, max_size=2, unique=True))
            a["kv_dtype"], b["kv_dtype"] = x, y
        elif field == "layout":
            a["layout"], b["layout"] = "page_first", "layer_first"
        elif field.endswith("_rank"):
            prefix = field[: -len("_rank")]
            size = draw(st.sampled_from(SIZES[1:]))
            r1, r2 = draw(st.lists(st.integers(0, size - 1), min_size=2, max_size=2, unique=True))
            a[f"{prefix}_size"] = b[f"{prefix}_size"] = size
            a[field], b[field] = r1, r2
        elif field.endswith("_size"):
            prefix = field[: -len("_size")]
            s1, s2 = draw(st.lists(st.sampled_from(SIZES), min_size=2, max_size=2, unique=True))
            rank = draw(st.integers(0, min(s1, s2) - 1))
            a[field], b[field] = s1, s2
            a[f"{prefix}_rank"] = b[f"{prefix}_rank"] = rank
        elif field == "page_hash":
            h = hashes[0]
            alike = [h.swapcase(), h[:-1] or h + "0", h + "0", h.replace("-", "_"), h.replace("_", "-")]
            hashes = list(dict.fromkeys([*hashes, *(x for x in alike if x and x[0].isalnum())]))
        diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
        return (
            a,
            b,
            hashes,
            ", ".join(f"{k}: {x!r} vs {y!r}" for k, (x, y) in diff.items()) or f"hashes {hashes}",
        )

    return cases()


Case = tuple[dict[str, Any], dict[str, Any], list[str], str]


def explicit_cases(field: str) -> list[Case]:
    """Cases every run checks first (hypothesis ``@example``): the classic collisions."""
    hashes = ["a0123456789abcdef"]
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    if field == "model_name":
        pairs = [({"model_name": x}, {"model_name": y}) for x, y in SLUG_ALIKE]
    elif field == "model_revision":
        pairs = [({"model_revision": x}, {"model_revision": y}) for x, y in REVISION_ALIKE]
    elif field.endswith("_size"):
        prefix = field[: -len("_size")]
        pairs = [({field: 2, f"{prefix}_rank": 0}, {field: 4, f"{prefix}_rank": 0})]
    elif field.endswith("_rank"):
        prefix = field[: -len("_rank")]
        pairs = [({field: 0, f"{prefix}_size": 2}, {field: 1, f"{prefix}_size": 2})]
    elif field == "kv_dtype":
        pairs = [({"kv_dtype": "fp8.e4m3"}, {"kv_dtype": "fp8-e4m3"})]
    elif field == "layout":
        pairs = [({"layout": "page_first"}, {"layout": "layer_first"})]
    else:
        pairs = [({}, {})]
    return [(a, b, hashes, f"{a} vs {b}" if a != b else "one config") for a, b in pairs]
