"""Fuzz the public entry points with random input: only typed ``HiCacheError`` s come out.

Config loading (random JSON / TOML / YAML files, random environments, random keyword arguments),
key and hash checks, page hashing, the pool constructors and ``HostPoolGroup``, the value types
(``PoolTransfer``, ``Capabilities``, ``DraftIo``) and the arguments of a real ``CacheController``
on the file backend (``page_hashes``, ``host_indices``, ``extra``, ``trailing_window``). An
exception that is not a :class:`hicache_core.HiCacheError` (a bare ``TypeError``, an
``AttributeError``, a pydantic ``ValidationError``...) fails the test with its traceback.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache_core as hc
from hicache_core import HiCacheError, env
from hicache_core.config import ControllerSettings, StorageConfig

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
FAST = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)

FIELDS = sorted(
    (set(StorageConfig.model_fields) | set(ControllerSettings.model_fields)) - {"backend", "options"}
)
BACKENDS = sorted(hc.backend_names())


def typed_only(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; a ``HiCacheError`` is fine, any other exception propagates (and fails)."""
    try:
        return fn(*args, **kwargs)
    except HiCacheError as err:
        assert str(err), "a hicache error says what went wrong"
        return None


# ------------------------------------------------------------------------------ strategies
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["inf", "-inf", "nan", "1e309", "0", "-1", "page_first", "file", "timeout", "true"])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
oddities = st.sampled_from(
    [
        object(),
        b"bytes",
        bytearray(b"x"),
        1j,
        math.inf,
        {1, 2},
        frozenset(),
        (),
        [],
        {},
        print,
        torch.zeros(2),
    ]
)
anything = json_values | oddities
hashable = (
    st.none() | st.integers() | st.text(max_size=8) | st.sampled_from([object(), 1j, frozenset(), (), b"kv"])
)
config_keys = st.sampled_from([*FIELDS, "backend", "options", "controller", "hicache"]) | st.text(max_size=10)
config_maps = st.dictionaries(config_keys, json_values, max_size=6)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps("" if value is None else str(value))  # TOML has no null


def _render(data: dict[str, Any], suffix: str) -> str:
    if suffix == ".json":
        return json.dumps(data)
    if suffix == ".toml":
        return "\n".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in data.items())
    return yaml.safe_dump(data)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hicache-fuzz-") as d:
        yield Path(d)


# -------------------------------------------------------------------------- config loading
def test_fuzz_config_files(scratch: Path) -> None:
    counter = iter(range(1 << 30))

    @FUZZ
    @given(
        data=config_maps,
        suffix=st.sampled_from([".json", ".toml", ".yaml", ".yml", ".ini"]),
        garbage=st.none() | st.binary(max_size=40),
        nest=st.booleans(),
    )
    def run(data: dict[str, Any], suffix: str, garbage: bytes | None, nest: bool) -> None:
        path = scratch / f"c{next(counter)}{suffix}"
        if garbage is not None:
            path.write_bytes(garbage)
        else:
            body = {"hicache": data} if nest else data
            path.write_text(_render(body, suffix), encoding="utf-8", errors="surrogatepass")
        cfg = typed_only(hc.load_config, path, environ={})
        assert cfg is None or isinstance(cfg, StorageConfig)
        typed_only(StorageConfig.from_file, path)
        typed_only(hc.load_config, environ={"HICACHE_CONFIG": str(path)})

    run()


def test_fuzz_config_paths(scratch: Path) -> None:
    @FAST
    @given(name=st.text(max_size=12).filter(lambda s: "/" not in s), other=anything)
    def run(name: str, other: Any) -> None:
        typed_only(hc.load_config, scratch / ("missing-" + name + ".json"), environ={})
        typed_only(hc.load_config, other, environ={})
        typed_only(StorageConfig.from_file, other)

    run()


env_names = st.sampled_from(
    [v.name for v in env.VARIABLES if v.name != "HICACHE_CONFIG"] + ["HICACHE_MODLE_NAME", "HICACHE_", "PATH"]
) | st.text(max_size=10).map(lambda s: "HICACHE_" + s if s.startswith("X") else s)


def test_fuzz_environment() -> None:
    @FUZZ
    @given(
        environ=st.dictionaries(env_names, st.text(max_size=16) | scalars.map(str), max_size=6),
        odd=st.none() | st.tuples(env_names | st.integers(), anything),
    )
    def run(environ: dict[str, str], odd: tuple[Any, Any] | None) -> None:
        given_env: dict[Any, Any] = dict(environ)
        if odd is not None:
            given_env[odd[0]] = odd[1]
        typed_only(hc.load_config, environ=given_env)
        typed_only(StorageConfig.from_env, given_env)

    run()
    typed_only(hc.load_config, environ=["HICACHE_BACKEND"])  # type: ignore[arg-type]


def test_fuzz_storage_config_arguments() -> None:
    @FUZZ
    @given(kwargs=st.dictionaries(config_keys.filter(lambda k: k != "hicache"), anything, max_size=5))
    def run(kwargs: dict[str, Any]) -> None:
        typed_only(StorageConfig, **kwargs)
        typed_only(StorageConfig.model_validate, kwargs)
        typed_only(StorageConfig().model_copy, update=kwargs)
        typed_only(ControllerSettings, **kwargs)
        typed_only(hc.load_config, environ={}, **kwargs)

    run()


def test_fuzz_open_store_overrides(scratch: Path) -> None:
    @FAST
    @given(
        kwargs=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), anything, max_size=3),
        backend=st.sampled_from(["file", *BACKENDS])
        | st.text(max_size=8).filter(lambda s: s not in BACKENDS),
        options=st.dictionaries(st.text(max_size=8).filter(lambda k: k != "root"), json_values, max_size=2),
    )
    def run(kwargs: dict[str, Any], backend: str, options: dict[str, Any]) -> None:
        if backend not in ("file", "") and backend in BACKENDS:
            backend = "file"  # only the file backend, always under the scratch directory
        opts = {**options, "root": str(scratch / "store")}
        store = typed_only(hc.open_store, backend=backend, options=opts, **kwargs)
        if store is not None:
            store.close()

    run()


# ------------------------------------------------------------------------- keys and hashes
def test_fuzz_keys_and_hashes() -> None:
    tokens = st.lists(st.integers(-(1 << 33), 1 << 33), max_size=40) | st.lists(anything, max_size=4)

    @FUZZ
    @given(
        obj=anything,
        text=st.text(max_size=300),
        token_ids=tokens | anything,
        page_size=st.integers(-2, 20) | anything.filter(lambda v: not isinstance(v, torch.Tensor)),
        prior=st.none() | st.text(max_size=70) | anything | st.just("ab" * 32),
    )
    def run(obj: Any, text: str, token_ids: Any, page_size: Any, prior: Any) -> None:
        for value in (obj, text):
            typed_only(hc.check_key, value)
            typed_only(hc.check_page_hash, value)
        out = typed_only(hc.page_hashes, token_ids, page_size, prior)
        assert out is None or all(hc.check_page_hash(h) == h for h in out)

    run()


def test_page_hashes_page_size_tensor_is_typed() -> None:
    typed_only(hc.page_hashes, [1, 2], torch.zeros(2))


# ------------------------------------------------------------------------------------ pools
small = st.integers(-2, 6)
dims = small | st.sampled_from([1 << 40, 2.0, "3", True, None, torch.tensor(2), torch.tensor([1, 2])])
dtypes = st.sampled_from(
    [
        torch.bfloat16,
        torch.uint8,
        "bfloat16",
        "fp16",
        "torch.float32",
        "bfloat17",
        "",
        "Tensor",
        None,
        3,
        object(),
    ]
)
layouts = st.sampled_from(["page_first", "layer_first", hc.Layout.PAGE_FIRST, "diagonal", None, 1])
allocators: st.SearchStrategy[Any] = st.sampled_from(
    [None, 5, "torch", lambda n: torch.zeros(n, dtype=torch.uint8), lambda n: torch.zeros(n), lambda n: None]
)


def _safe_alloc(*dims_: Any) -> bool:
    """Allocate only small pools (a fuzzer must never take gigabytes of a shared machine)."""
    return all(type(d) is int and d <= 8 for d in dims_)


def test_fuzz_pool_constructors() -> None:
    @FUZZ
    @given(
        d=st.tuples(dims, dims, dims, dims, dims),
        dtype=dtypes,
        layout=layouts,
        allocator=allocators,
        shapes=st.lists(st.lists(small, max_size=3) | anything, max_size=3) | anything,
        temporal=st.lists(small, max_size=3) | anything,
        name=st.text(max_size=6) | anything,
    )
    def run(
        d: tuple[Any, ...], dtype: Any, layout: Any, allocator: Any, shapes: Any, temporal: Any, name: Any
    ) -> None:
        alloc = _safe_alloc(*d)
        kw = {"layout": layout, "allocate": alloc, "allocator": allocator}
        typed_only(hc.MHAKVPool, *d, dtype, **kw)
        typed_only(hc.MLAKVPool, *d[:4], dtype, **kw)
        typed_only(hc.IndexerPool, *d[:4], dtype, **kw)
        typed_only(hc.MambaPool, d[0], d[1], temporal, shapes, dtype, dtype, **{**kw, "allocate": False})
        spec = typed_only(hc.ComponentSpec, name, d[0], temporal, dtype)
        if spec is not None:
            typed_only(hc.HostPool, [spec], d[1], layout=layout, page_size=d[2], allocate=False)
        typed_only(hc.HostPool, shapes, d[1], allocate=False)

    run()


def test_fuzz_host_pool_group() -> None:
    kv = hc.MHAKVPool(4, 1, 1, 1, 4, allocate=False)
    mamba = hc.MambaPool(2, 1, (2,), [(3,)], allocate=False)
    pool_names = st.sampled_from([*hc.PoolName, "kv", "mamba", "draft", "weights", ""]) | st.integers()

    @FUZZ
    @given(
        anchor=st.sampled_from([kv, mamba]) | anything,
        extras=st.dictionaries(pool_names, st.sampled_from([kv, mamba]) | anything, max_size=3) | anything,
        lookup=pool_names | anything,
    )
    def run(anchor: Any, extras: Any, lookup: Any) -> None:
        group = typed_only(hc.HostPoolGroup, anchor, extras)
        if group is not None:
            typed_only(group.__getitem__, lookup)
            assert isinstance(lookup in group, bool)
            typed_only(group.get, lookup)

    run()


def test_fuzz_value_types() -> None:
    @FUZZ
    @given(
        pool=st.sampled_from(["kv", "mamba", hc.PoolName.DRAFT]) | anything,
        indices=st.lists(small, max_size=3) | st.lists(anything, max_size=3) | anything,
        hashes=st.lists(st.text(max_size=5), max_size=3) | anything,
        keys=st.lists(st.lists(st.text(max_size=3), max_size=2) | anything, max_size=3) | anything,
        policy=st.sampled_from(["all_pages", "trailing_pages"]) | anything,
        flags=st.fixed_dictionaries(
            {}, optional={f: anything | st.booleans() for f in ("v1", "v2", "zero_copy")}
        ),
        pools=st.lists(st.sampled_from(["kv", "mamba"]) | anything, max_size=3) | anything,
        mode=st.sampled_from(list(hc.DraftIoMode)) | anything,
    )
    def run(
        pool: Any,
        indices: Any,
        hashes: Any,
        keys: Any,
        policy: Any,
        flags: dict[str, Any],
        pools: Any,
        mode: Any,
    ) -> None:
        typed_only(hc.PoolTransfer, pool, indices, hashes, policy, keys)
        typed_only(hc.Capabilities, pools=pools, draft_io=mode, **flags)
        typed_only(hc.DraftIo, mode, pool)

    run()


# ------------------------------------------------------------------------------ controller
OPS = ["backup", "prefetch", "query", "backup_async", "prefetch_async", "query_async"]


def test_fuzz_controller_arguments(scratch: Path) -> None:
    kv = hc.MHAKVPool(8, 2, 1, 1, 4)
    group = hc.HostPoolGroup(
        kv,
        {
            hc.PoolName.MAMBA: hc.MambaPool(4, 1, (2,), [(3,)]),
            hc.PoolName.INDEXER: hc.IndexerPool(8, 2, 1, 4),
        },
    )
    cfg = StorageConfig(
        backend="file", options={"root": str(scratch / "ctl")}, model_name="fuzz", batch_pages=2
    )
    valid = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(8)]  # not page_hashes: own test
    index_lists = st.lists(st.integers(-2, 10), max_size=9)
    index_like = (
        index_lists
        | index_lists.map(lambda v: torch.tensor(v, dtype=torch.int64))
        | st.lists(anything, max_size=3)
        | anything
    )
    random_hashes = st.lists(st.text(max_size=6) | anything, max_size=4) | anything

    def slots(size: int) -> st.SearchStrategy[int]:
        return st.integers(0, size - 1)

    pool_keys = st.sampled_from(["kv", "mamba", "indexer", "draft", hc.PoolName.MAMBA, "weights"]) | hashable

    with hc.CacheController(cfg, group) as ctl:

        @FUZZ
        @given(data=st.data(), op=st.sampled_from(OPS))
        def run(data: st.DataObject, op: str) -> None:
            # About half the draws are well-formed, so the I/O paths run too, not only the checks.
            n = data.draw(st.integers(0, 8), "n")
            good = data.draw(st.booleans(), "good")
            hashes = valid[:n] if good else data.draw(random_hashes, "hashes")
            host = data.draw(st.lists(slots(8), min_size=n, max_size=n) if good else index_like, "host")
            extra = data.draw(
                st.none()
                | st.fixed_dictionaries(
                    {},
                    optional={
                        "mamba": st.lists(slots(4), max_size=n),
                        "indexer": st.lists(slots(8), min_size=n),
                    },
                )
                | st.dictionaries(pool_keys, index_like, max_size=2)
                | anything,
                "extra",
            )
            window = data.draw(st.integers(1, 4) if good else st.integers(-1, 9) | anything, "window")
            if op.startswith("query"):
                out = typed_only(getattr(ctl, op), hashes, trailing_window=window)
            else:
                out = typed_only(getattr(ctl, op), hashes, host, extra)
            if out is not None and op.endswith("_async"):
                out = out.result(timeout=30)  # a prefetch handle or a future
            if out is not None:
                assert out.pages >= 0 and (out.pages <= n or not good)
                assert not out.errors, out.errors  # well-formed or refused: never a failed call

        run()

    # The constructor: the pools argument (the config and store are another layer's checks).
    @FAST
    @given(pools=st.sampled_from([kv, group]) | anything)
    def construct(pools: Any) -> None:
        made = typed_only(hc.CacheController, cfg, pools)
        if made is not None:
            made.close()

    construct()
