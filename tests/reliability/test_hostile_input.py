"""Hostile input: hypothesis fuzzing of keys, page hashes, batch shapes, options and config files.

Only typed hicache errors may escape (``HiCacheError`` subclasses; pydantic errors come
wrapped as ``OptionsError``/``ConfigError`` naming the backend or source). Untyped escapes that
match a known bug (``_hostile.KNOWN``, each with a strict-xfail test below and a fix in the
report) are counted; any other one fails. For the file backend no byte may be written outside
its root (the directory around the root is snapshotted) and previously stored pages must
survive every case.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache_core as hc
from hicache_core import PoolName, PoolTransfer
from tests.reliability._hostile import Tally
from tests.reliability._util import HAVE_FILE, HAVE_HF3FS, hex_hash, report, tree
from tests.support.distinfo import installed_dist
from tests.support.membackend import MEMORY_ENTRY_POINTS, SHARED

pytestmark = pytest.mark.timeout(300)

SENTINELS = [hex_hash("sentinel", i) for i in range(4)]


def _examples(long_mode: bool, n: int) -> Any:
    return settings(
        max_examples=n * (10 if long_mode else 1),
        deadline=None,
        database=None,
        derandomize=not long_mode,
        suppress_health_check=list(HealthCheck),
    )


# ------------------------------------------------------------------ strategies
SPECIAL_KEYS = [
    "",
    ".",
    "..",
    "a/b",
    "../../etc/passwd",
    "a\\b",
    "a\0b",
    "x" * 300,
    "ns..kv",
    "a\udc80b",
    " ",
    "-a",
]
keys_st = st.one_of(
    st.sampled_from(SPECIAL_KEYS),
    st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=300),
    st.text(alphabet="abc./\\\0-_", max_size=40),
    st.binary(max_size=40),
    st.integers(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
hashes_st = st.one_of(
    st.sampled_from(["", "..", "a/b", "x" * 129, "a.b", "\0", "ab\udc80"]),
    st.text(max_size=140),
    st.binary(max_size=20),
    st.integers(),
    st.none(),
    st.floats(allow_nan=True),
)
dtype_st = st.sampled_from([torch.uint8, torch.int8, torch.float32, torch.int64, torch.bool, torch.bfloat16])


@st.composite
def buffer_st(draw: Any) -> Any:
    kind = draw(
        st.sampled_from(
            ["ok", "dtype", "size", "meta", "noncontig", "zero-dim", "empty", "bytes", "none", "numpy"]
        )
    )
    n = 16
    if kind == "ok":
        return torch.zeros(n, dtype=torch.uint8)
    if kind == "dtype":
        return torch.zeros(n, dtype=draw(dtype_st))
    if kind == "size":
        return torch.zeros(draw(st.integers(0, 64)), dtype=torch.uint8)
    if kind == "meta":
        return torch.empty(n, dtype=torch.uint8, device="meta")
    if kind == "noncontig":
        return torch.zeros(n, 3, dtype=torch.uint8)[:, 1]
    if kind == "zero-dim":
        return torch.tensor(7, dtype=torch.uint8)
    if kind == "empty":
        return torch.zeros(0, dtype=torch.uint8)
    if kind == "bytes":
        return b"x" * n
    if kind == "numpy":
        return torch.zeros(n, dtype=torch.uint8).numpy()
    return None


# --------------------------------------------------------------------- fixtures
@pytest.fixture
def memory(tmp_path: Path) -> Iterator[None]:
    SHARED.clear()
    with installed_dist(
        tmp_path / "site", "hicache-test-memory", {"hicache.backends": MEMORY_ENTRY_POINTS}, {}
    ):
        yield
    SHARED.clear()


def _backends() -> list[Any]:
    return [
        "memory",
        pytest.param("file", marks=pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed")),
    ]


class Fixture:
    """An open store + controller with sentinel pages, and the filesystem around its root."""

    def __init__(self, backend: str, tmp: Path) -> None:
        self.outside = tmp / "around"
        self.root = self.outside / "root"
        self.root.mkdir(parents=True)
        (self.outside / "neighbour.txt").write_text("do not touch")
        options = {"root": str(self.root)} if backend == "file" else {}
        self.kv = hc.MHAKVPool(8, 4, 1, 1, 8, allocate=False)
        self.ctl = hc.CacheController(
            hc.StorageConfig(backend=backend, options=options), hc.HostPoolGroup(self.kv)
        )
        self.store = self.ctl.store
        for b in self.kv.buffers():
            b.copy_(
                torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
            )
        self.saved = [b[:4].clone() for b in self.kv.buffers()]
        assert self.ctl.backup(SENTINELS, range(4)).pages == 4
        self.before = {k: v for k, v in tree(self.outside).items() if not k.startswith("root/")}

    def check(self) -> None:
        after = {k: v for k, v in tree(self.outside).items() if not k.startswith("root/")}
        assert after == self.before, (
            f"files changed outside the backend root: {set(after) ^ set(self.before)}"
        )
        for b in self.kv.buffers():
            b[4:].zero_()
        assert self.ctl.prefetch(SENTINELS, range(4, 8)).pages == 4, "a previously stored page was lost"
        for b, s in zip(self.kv.buffers(), self.saved):
            assert torch.equal(b[4:8], s)

    def close(self) -> None:
        self.ctl.close()


def _finish(record_property: Any, name: str, tallies: list[Tally]) -> None:
    summary = {t.name: t.summary() for t in tallies}
    report(record_property, name, cases=sum(t.cases for t in tallies), **summary)
    unknown = [u for t in tallies for u in t.unknown]
    assert not unknown, "untyped errors escaped:\n" + "\n".join(unknown[:20])


# ------------------------------------------------------------------------ tests
@pytest.mark.parametrize("backend", _backends())
def test_fuzz_keys_and_batch_shapes(
    memory, backend: str, tmp_path: Path, long_mode: bool, record_property
) -> None:
    fx = Fixture(backend, tmp_path)
    keys_t, shapes_t, v2_t = Tally("keys"), Tally("buffers"), Tally("v2")
    valid = [k for ks in fx.store.page_keys(PoolName.KV, [hex_hash("fuzz", 0)]) for k in ks]

    @_examples(long_mode, 150)
    @given(
        op=st.sampled_from(["exists", "get", "set", "delete", 7, None]), keys=st.lists(keys_st, max_size=4)
    )
    def fuzz_keys(op: Any, keys: list[Any]) -> None:
        bufs = [torch.zeros(16, dtype=torch.uint8) for _ in keys]
        keys_t.run(lambda: fx.store.batch_io_v1(op, keys, bufs))

    @_examples(long_mode, 150)
    @given(
        op=st.sampled_from(["get", "set"]), bufs=st.lists(buffer_st(), max_size=3), extra=st.integers(-1, 1)
    )
    def fuzz_buffers(op: str, bufs: list[Any], extra: int) -> None:
        keys = (valid * 3)[: max(0, len(bufs) + extra)]
        if op == "get":
            marks = [
                b.clone() if isinstance(b, torch.Tensor) and b.device.type == "cpu" else None for b in bufs
            ]
            res = shapes_t.run(lambda: fx.store.batch_io_v1(op, keys, bufs))
            for b, m, ok in zip(bufs, marks, res or []):
                if m is not None and not ok and b.numel() and b.dtype == torch.uint8:
                    assert torch.equal(b, m), "a failed get modified the buffer (partial copy)"
        else:
            shapes_t.run(lambda: fx.store.batch_io_v1(op, keys, bufs))

    @_examples(long_mode, 100)
    @given(
        op=st.sampled_from(["exists", "get", "set"]),
        pool=st.sampled_from(["kv", "mamba", "draft"]),
        idx=st.lists(st.integers(-3, 12), max_size=4),
        hashes=st.lists(hashes_st, max_size=4),
    )
    def fuzz_v2(op: str, pool: str, idx: list[int], hashes: list[Any]) -> None:
        def call() -> Any:
            keys = fx.store.page_keys(pool, hashes)
            return fx.store.batch_io_v2(op, [PoolTransfer(pool, idx, hashes, keys=keys)])

        v2_t.run(call)

    try:
        fuzz_keys()
        fuzz_buffers()
        fuzz_v2()
        fx.check()
    finally:
        fx.close()
    _finish(record_property, f"hostile-io-{backend}", [keys_t, shapes_t, v2_t])


@pytest.mark.parametrize("backend", _backends())
def test_fuzz_controller_inputs(
    memory, backend: str, tmp_path: Path, long_mode: bool, record_property
) -> None:
    fx = Fixture(backend, tmp_path)
    hashes_t, index_t, extra_t = Tally("page_hashes"), Tally("host_indices"), Tally("extra")
    idx_st = st.one_of(
        st.lists(
            st.one_of(st.integers(-10, 20), st.floats(allow_nan=True), st.text(max_size=3), st.none()),
            max_size=4,
        ),
        st.none(),
        st.integers(),
        st.text(max_size=4),
    )

    @_examples(long_mode, 150)
    @given(
        hashes=st.one_of(st.lists(hashes_st, max_size=4), hashes_st),
        window=st.one_of(st.integers(-2, 3), st.text(max_size=2)),
    )
    def fuzz_hashes(hashes: Any, window: Any) -> None:
        hashes_t.run(lambda: fx.ctl.backup(hashes, range(len(hashes)) if isinstance(hashes, list) else [0]))
        hashes_t.run(lambda: fx.ctl.query(hashes, trailing_window=window))
        hashes_t.run(lambda: fx.ctl.prefetch_async(hashes, [4]).result(timeout=10))

    @_examples(long_mode, 150)
    @given(idx=idx_st, n=st.integers(0, 3))
    def fuzz_indices(idx: Any, n: int) -> None:
        hs = [hex_hash("idx", i) for i in range(n)]
        index_t.run(lambda: fx.ctl.backup(hs, idx))
        index_t.run(lambda: fx.ctl.prefetch(hs, idx))

    @_examples(long_mode, 60)
    @given(
        extra=st.dictionaries(
            st.one_of(st.sampled_from(["mamba", "kv", "draft", "bogus"]), st.integers()), idx_st, max_size=2
        )
    )
    def fuzz_extra(extra: Any) -> None:
        extra_t.run(lambda: fx.ctl.backup([hex_hash("x", 0)], [5], extra))

    try:
        fuzz_hashes()
        fuzz_indices()
        fuzz_extra()
        fx.check()
    finally:
        fx.close()
    _finish(record_property, f"hostile-controller-{backend}", [hashes_t, index_t, extra_t])


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0, 1, 2**31, 2**63, 10**30, "1GiB", "-5", "abc", "$HOME", "nan"]),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
OPTION_FIELDS = {
    "memory": ["fail_pools", "raise_on"],
    "file": ["root", "max_bytes", "fsync", "io_threads", "parallel_min_bytes", "temp_max_age_s"],
    "hf3fs": ["file_path_prefix", "file_size", "num_slots", "bytes_per_page", "fsync"],
}


def _option_backends() -> list[Any]:
    out: list[Any] = ["memory"]
    out.append(
        pytest.param("file", marks=pytest.mark.skipif(not HAVE_FILE, reason="hicache-file not installed"))
    )
    out.append(
        pytest.param(
            "hf3fs", marks=pytest.mark.skipif(not HAVE_HF3FS, reason="hicache-hf3fs-stub not installed")
        )
    )
    return out


@pytest.mark.parametrize("backend", _option_backends())
def test_fuzz_options(memory, backend: str, tmp_path: Path, long_mode: bool, record_property) -> None:
    tally = Tally("options")
    outside = tmp_path / "around"
    outside.mkdir()
    names = st.one_of(st.sampled_from(OPTION_FIELDS[backend]), st.text(max_size=6))
    path_st = st.builds(lambda s: str(outside / "root" / s), st.text(alphabet="ab./-_ ", max_size=12))
    counter = iter(range(10**9))
    roots: set[str] = set()  # resolved directories the fuzzed options point at

    @_examples(long_mode, 120)
    @given(
        opts=st.dictionaries(names, VALUES, max_size=4),
        path=path_st,
        options_type=st.sampled_from(["dict", "list", "str"]),
    )
    def fuzz(opts: dict[str, Any], path: str, options_type: str) -> None:
        opts = dict(opts)
        if backend == "file":  # hostile spellings, but always under the directory we watch
            opts["root"] = path
            roots.add(os.path.realpath(path))
        if backend == "hf3fs":
            opts["file_path_prefix"] = f"{path}/h{next(counter)}"
            roots.add(os.path.realpath(path))
            opts.pop("fallocate", None)  # never reserve absurd sizes on the real disk
        given_opts: Any = (
            opts if options_type == "dict" else (list(opts) if options_type == "list" else json.dumps(opts))
        )

        def roundtrip() -> None:
            kv = hc.MHAKVPool(2, 4, 1, 1, 8)
            cfg = hc.StorageConfig.model_construct(
                **{**hc.StorageConfig().__dict__, "backend": backend, "options": given_opts}
            )
            with hc.CacheController(cfg, hc.HostPoolGroup(kv)) as ctl:
                hs = [hex_hash("opt", 0)]
                ctl.backup(hs, [0])
                ctl.prefetch(hs, [1])

        tally.run(roundtrip)

    before = tree(outside)
    fuzz()
    after = tree(outside)
    stray = [
        p
        for p in set(after) - set(before)
        if not any(os.path.realpath(outside / p).startswith(r + os.sep) for r in roots)
    ]
    _finish(record_property, f"hostile-options-{backend}", [tally])
    assert not stray, f"files written outside the configured roots: {stray[:5]}"


def test_fuzz_config_files_and_env(tmp_path: Path, long_mode: bool, record_property) -> None:
    files_t, env_t, raw_t = Tally("config_files"), Tally("environment"), Tally("raw_bytes")
    field_names = st.one_of(
        st.sampled_from([*hc.StorageConfig.model_fields, "batch_pages", "io_timeout_s", "bogus"]),
        st.text(max_size=6),
    )
    counter = iter(range(10**9))

    def write(fmt: str, data: Any) -> Path:
        path = tmp_path / f"cfg{next(counter)}.{fmt}"
        if fmt == "json":
            path.write_text(json.dumps(data, default=str))
        elif fmt == "yaml":
            import yaml

            path.write_text(yaml.safe_dump(json.loads(json.dumps(data, default=str))))
        else:
            lines = [
                f"{k} = {json.dumps(v, default=str)}"
                for k, v in data.items()
                if isinstance(k, str) and k.isidentifier()
            ]
            path.write_text("\n".join(lines))
        return path

    crafted = st.sampled_from(
        [
            {"batch_pages": 4, "controller": 5},
            {"io_threads": 2, "controller": [1, 2]},
            {"options": [1]},
            {"hicache": 5},
        ]
    )

    @_examples(long_mode, 150)
    @given(
        data=st.one_of(st.dictionaries(field_names, VALUES, max_size=5), crafted),
        fmt=st.sampled_from(["json", "yaml", "toml"]),
    )
    def fuzz_files(data: dict[str, Any], fmt: str) -> None:
        path = write(fmt, data)
        files_t.run(lambda: hc.load_config(path, environ={}))

    @_examples(long_mode, 150)
    @given(
        env=st.dictionaries(
            st.builds(lambda s: "HICACHE_" + s.upper(), field_names),
            st.one_of(
                st.text(max_size=12), st.sampled_from(["[1, 2]", "{}", "5", '"x"', "null", '{"root": 5}'])
            ),
            max_size=3,
        )
    )
    def fuzz_env(env: dict[str, str]) -> None:
        base = write("json", {"options": {"root": "/tmp/x"}, "batch_pages": 4})
        env_t.run(lambda: hc.load_config(base, environ=env))

    @_examples(long_mode, 100)
    @given(raw=st.binary(max_size=200), fmt=st.sampled_from(["json", "yaml", "yml", "toml", "ini"]))
    def fuzz_raw(raw: bytes, fmt: str) -> None:
        path = tmp_path / f"raw{next(counter)}.{fmt}"
        path.write_bytes(raw)
        raw_t.run(lambda: hc.load_config(path, environ={}))

    fuzz_files()
    fuzz_env()
    fuzz_raw()
    _finish(record_property, "hostile-config", [files_t, env_t, raw_t])


# ------------------------------------- regressions for bugs the fuzzing found (K1-K8)
def _typed(fn: Any) -> None:
    try:
        fn()
    except hc.HiCacheError:
        return
    except Exception as err:
        raise AssertionError(f"untyped {type(err).__name__}: {err}") from None


def test_unknown_op_is_typed(memory) -> None:
    with hc.open_store(hc.StorageConfig(backend="memory")) as store:
        _typed(lambda: store.batch_io_v1("delete", ["k"], [torch.zeros(1, dtype=torch.uint8)]))


def test_unknown_pool_name_is_typed(memory) -> None:
    with hc.open_store(hc.StorageConfig(backend="memory")) as store:
        _typed(lambda: store.page_keys("bogus", [hex_hash("p", 0)]))


def test_non_sequence_hashes_are_typed(memory) -> None:
    kv = hc.MHAKVPool(2, 4, 1, 1, 8, allocate=False)
    with hc.CacheController(hc.StorageConfig(backend="memory"), hc.HostPoolGroup(kv)) as ctl:
        _typed(lambda: ctl.query(5))  # type: ignore[arg-type]


def test_non_integer_host_indices_are_typed(memory) -> None:
    kv = hc.MHAKVPool(2, 4, 1, 1, 8, allocate=False)
    with hc.CacheController(hc.StorageConfig(backend="memory"), hc.HostPoolGroup(kv)) as ctl:
        _typed(lambda: ctl.backup([hex_hash("i", 0)], [None]))


def test_non_mapping_controller_is_typed(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"batch_pages": 4, "controller": 5}))
    _typed(lambda: hc.load_config(path, environ={}))


def test_non_object_env_options_are_typed(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"options": {"root": "/tmp/x"}}))
    _typed(lambda: hc.load_config(path, environ={"HICACHE_OPTIONS": "[1, 2]"}))


def test_backend_exception_through_store_is_typed(memory) -> None:
    with hc.open_store(hc.StorageConfig(backend="memory")) as store:
        _typed(lambda: store.batch_io_v1("set", [["unhashable"]], [torch.zeros(1, dtype=torch.uint8)]))


def test_non_integer_window_is_typed(memory) -> None:
    kv = hc.MHAKVPool(2, 4, 1, 1, 8, allocate=False)
    with hc.CacheController(hc.StorageConfig(backend="memory"), hc.HostPoolGroup(kv)) as ctl:
        _typed(lambda: ctl.query([hex_hash("w", 0)], trailing_window="1"))  # type: ignore[arg-type]
