"""Discovery through real entry points: lazy listing, allow/block lists, typed errors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import hicache_core as hc
from hicache_core.plugin import registry as _registry
from tests.support.distinfo import installed_dist

GOOD = """
from pydantic import BaseModel, ConfigDict
from hicache_core import Capabilities, DraftIo, DraftIoMode, hookimpl

IMPORTED = True

class Backend:
    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        size: int = 1

    capabilities = Capabilities(v1=True, draft_io=DraftIoMode.GENERIC)

    def __init__(self, config, options):
        self.options = options

    @hookimpl
    def hicache_register_pool(self, pool_name, pool):
        pass

    @hookimpl
    def hicache_draft_io_capability(self):
        return DraftIo(DraftIoMode.GENERIC)

    @hookimpl
    def hicache_batch_io_v1(self, op, keys, buffers):
        return [False] * len(keys)
"""


def _install(
    tmp_path: Path, source: str, name: str = "thing", module: str = "thirdparty_thing", dist: str = ""
):
    return installed_dist(
        tmp_path / "site",
        dist or f"hicache-{name}",
        {"hicache.backends": {name: f"{module}:Backend"}},
        {module: source},
        version="1.2.3",
    )


def test_listing_reads_metadata_without_importing(tmp_path: Path) -> None:
    with _install(tmp_path, GOOD):
        infos = hc.find_backends()
        assert infos["thing"].distribution == "hicache-thing"
        assert infos["thing"].version == "1.2.3"
        assert "thirdparty_thing" not in sys.modules  # listing is lazy
        cls = hc.load_backend_class("thing")
        assert sys.modules["thirdparty_thing"].IMPORTED
        assert cls.__name__ == "Backend"


def test_describe_reports_capabilities(tmp_path: Path) -> None:
    with _install(tmp_path, GOOD):
        row = _registry.describe_backend("thing")
        assert row["status"] == "ok"
        assert row["draft_io"] == "generic"
        assert row["capabilities"]["v1"] is True and row["v2"] is False


def test_unknown_name_lists_installed_and_suggests(tmp_path: Path) -> None:
    with _install(tmp_path, GOOD):
        with pytest.raises(hc.BackendNotFoundError) as info:
            hc.load_backend_class("thnig")
    msg = str(info.value)
    assert "'thing'" in msg and "Did you mean 'thing'?" in msg
    assert isinstance(info.value, LookupError)


def test_block_and_allow_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _install(tmp_path, GOOD):
        monkeypatch.setenv("HICACHE_BACKENDS_BLOCK", "thing")
        assert "thing" not in hc.backend_names()
        with pytest.raises(hc.BackendNotFoundError, match="HICACHE_BACKENDS_BLOCK"):
            hc.load_backend_class("thing")
        monkeypatch.delenv("HICACHE_BACKENDS_BLOCK")
        monkeypatch.setenv("HICACHE_BACKENDS_ALLOW", "other")
        assert "thing" not in hc.backend_names()
        monkeypatch.setenv("HICACHE_BACKENDS_ALLOW", "other, thing")
        assert "thing" in hc.backend_names()


def test_missing_dependency_names_distribution_and_module(tmp_path: Path) -> None:
    with _install(tmp_path, "import not_a_real_sdk_xyz\n" + GOOD):
        with pytest.raises(hc.BackendUnavailableError) as info:
            hc.load_backend_class("thing")
    msg = str(info.value)
    assert "hicache-thing" in msg and "not_a_real_sdk_xyz" in msg
    assert "thing = 'thirdparty_thing:Backend'" in msg
    # an import name is not a distribution name: never `pip install not_a_real_sdk_xyz`
    assert "pip install" not in msg and "does not declare" in msg


def test_missing_declared_dependency_says_reinstall_the_plugin(tmp_path: Path) -> None:
    with _install(tmp_path, "import not_a_real_sdk_xyz\n" + GOOD) as site:
        (metadata,) = site.glob("*.dist-info/METADATA")
        with metadata.open("a") as f:
            f.write("Requires-Dist: Not_A_Real-SDK-xyz>=1.2; python_version >= '3'\n")
        with pytest.raises(hc.BackendUnavailableError) as info:
            hc.load_backend_class("thing")
    msg = str(info.value)
    assert "'Not_A_Real-SDK-xyz>=1.2'" in msg and "reinstall hicache-thing" in msg
    assert "pip install Not" not in msg and "pip install not" not in msg


def test_entry_point_module_typo_is_a_contract_error_never_an_install(tmp_path: Path) -> None:
    with installed_dist(
        tmp_path / "site",
        "hicache-thing",
        {"hicache.backends": {"thing": "thirdparty_thnig:Backend"}},
        {"thirdparty_thing": GOOD},
    ):
        with pytest.raises(hc.BackendContractError) as info:
            hc.load_backend_class("thing")
        row = _registry.describe_backend("thing")
    msg = str(info.value)
    assert "pip install" not in msg, msg
    assert (
        "'thirdparty_thnig'" in msg and "does not exist" in msg and "did you mean 'thirdparty_thing'" in msg
    )
    assert "hicache-thing" in msg and "entry point 'thing'" in msg
    assert row["status"].startswith("broken: ")


def test_module_dot_class_entry_point_is_diagnosed(tmp_path: Path) -> None:
    with installed_dist(
        tmp_path / "site",
        "hicache-thing",
        {"hicache.backends": {"thing": "thirdparty_thing.Backend"}},
        {"thirdparty_thing": GOOD},
    ):
        with pytest.raises(hc.BackendContractError) as info:
            hc.load_backend_class("thing")
    msg = str(info.value)
    assert "'module:Class'" in msg and "'thirdparty_thing:Backend'" in msg and "pip install" not in msg


def test_entry_point_naming_a_module_suggests_the_class(tmp_path: Path) -> None:
    with installed_dist(
        tmp_path / "site",
        "hicache-thing",
        {"hicache.backends": {"thing": "thirdparty_thing"}},
        {"thirdparty_thing": GOOD},
    ):
        with pytest.raises(hc.BackendContractError, match="thirdparty_thing:Backend"):
            hc.load_backend_class("thing")


def test_missing_module_of_an_installed_distribution_is_not_an_install(tmp_path: Path) -> None:
    with _install(tmp_path, "import hicache_core.no_such_module_xyz\n" + GOOD):
        with pytest.raises(hc.BackendUnavailableError) as info:
            hc.load_backend_class("thing")
    msg = str(info.value)
    assert "'hicache_core.no_such_module_xyz'" in msg and "hicache-core" in msg and "is installed" in msg
    assert "pip install" not in msg


def test_unknown_name_near_miss_never_suggests_an_install(tmp_path: Path) -> None:
    with _install(tmp_path, GOOD):
        with pytest.raises(hc.BackendNotFoundError) as info:
            hc.load_backend_class("thnig")
    assert "Did you mean 'thing'?" in str(info.value) and "pip install" not in str(info.value)
    with pytest.raises(hc.BackendNotFoundError) as info:
        hc.load_backend_class("zz-nothing-like-it")
    assert "pip install" not in str(info.value)


def test_unknown_project_backend_names_its_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_registry, "_filtered", lambda group, environ: ({}, set()))
    with pytest.raises(hc.BackendNotFoundError) as info:
        hc.load_backend_class("mooncake")
    assert "`pip install hicache-mooncake`" in str(info.value)


def test_unvalidated_load_returns_a_broken_class(tmp_path: Path) -> None:
    with _install(tmp_path, GOOD.replace('extra="forbid"', 'extra="allow"')):
        with pytest.raises(hc.BackendContractError):
            hc.load_backend_class("thing")
        cls = _registry.load_backend_class("thing", validate=False)
    assert cls.__name__ == "Backend"


PATHS = """
from pathlib import Path
from typing import Optional
from pydantic import BaseModel, DirectoryPath, Field, FilePath, NewPath

class Options(BaseModel):
    path: Path | None = None
    legacy: Optional[Path] = None
    fixed: Path = Path("/nonexistent/x")
    cache: DirectoryPath | None = None
    new: NewPath | None = None
    prefix: str | None = Field(None, json_schema_extra={"format": "path"})
    root: str | None = None
    existing: FilePath | None = None
    paths: list[Path] = []
    name: str = "x"
    size: int = 1
"""


def test_path_options_by_type_or_marker_not_by_name(tmp_path: Path) -> None:
    ns: dict[str, Any] = {}
    exec(compile(PATHS, "paths_options", "exec", dont_inherit=True), ns)  # real annotations
    options = ns["Options"]
    assert _registry.path_options(options) == {
        "path": "path",
        "legacy": "path",
        "fixed": "path",
        "cache": "dir",
        "new": "path",
        "prefix": "path",
        "root": "path",  # LEGACY_PATH_OPTIONS: str fields of backends written before
    }
    out = _registry.with_fresh_paths(options, {"path": "/mine", "size": 2}, tmp_path)
    assert out["path"] == "/mine" and out["size"] == 2
    assert out["legacy"] == str(tmp_path / "hicache-legacy") and not (tmp_path / "hicache-legacy").exists()
    assert (tmp_path / "hicache-cache").is_dir()  # a DirectoryPath must exist
    assert "existing" not in out and "paths" not in out and "name" not in out
    options.model_validate(out)  # every filled value is valid for the model


@pytest.mark.parametrize(
    ("mutation", "expected"),
    [
        (("def hicache_batch_io_v1(", "def hicache_batchio_v1("), "did you mean 'hicache_batch_io_v1'"),
        (
            ("    @hookimpl\n    def hicache_draft_io_capability", "    def hicache_draft_io_capability"),
            "not marked",
        ),
        (('extra="forbid"', 'extra="allow"'), "forbid unknown fields"),
        (
            ("capabilities = Capabilities(v1=True, draft_io=DraftIoMode.GENERIC)", "capabilities = None"),
            "capabilities",
        ),
        (
            (
                "def hicache_batch_io_v1(self, op, keys, buffers)",
                "def hicache_batch_io_v1(self, op, key, buffers)",
            ),
            "['key']",
        ),
        (("        size: int = 1", "        size: int"), "defaults"),
        (("def __init__(self, config, options)", "def __init__(self)"), "(config, options)"),
    ],
)
def test_contract_violations_are_refused_at_load(
    tmp_path: Path, mutation: tuple[str, str], expected: str
) -> None:
    old, new = mutation
    assert old in GOOD
    with _install(tmp_path, GOOD.replace(old, new)):
        with pytest.raises(hc.BackendContractError) as info:
            hc.load_backend_class("thing")
    assert expected in str(info.value)
    assert "hicache-thing" in str(info.value)  # the plugin is named


def test_missing_required_hook(tmp_path: Path) -> None:
    source = GOOD.replace(
        "capabilities = Capabilities(v1=True,", "capabilities = Capabilities(v1=True, v2=True,"
    )
    with _install(tmp_path, source):
        with pytest.raises(hc.BackendContractError, match="hicache_batch_io_v2"):
            hc.load_backend_class("thing")


def test_same_name_from_two_distributions_is_ambiguous(tmp_path: Path) -> None:
    with (
        _install(tmp_path / "a", GOOD, module="mod_a", dist="acme-a"),
        _install(tmp_path / "b", GOOD, module="mod_b", dist="acme-b"),
    ):
        with pytest.raises(hc.BackendContractError, match="several distributions"):
            hc.load_backend_class("thing")


def test_availability_reason_blocks_open(tmp_path: Path) -> None:
    source = (
        GOOD
        + """
    @classmethod
    def availability(cls):
        return "needs the vendor SDK (acme-sdk; pip install acme-sdk)"
"""
    )
    with _install(tmp_path, source):
        row = _registry.describe_backend("thing")
        assert row["status"].startswith("unavailable: needs the vendor SDK")
        with pytest.raises(hc.BackendUnavailableError, match="acme-sdk"):
            hc.open_store(hc.StorageConfig(backend="thing"))


def test_options_errors_name_backend_and_field(tmp_path: Path) -> None:
    with _install(tmp_path, GOOD):
        with pytest.raises(hc.OptionsError) as info:
            hc.open_store(hc.StorageConfig(backend="thing", options={"size": "big", "colour": 1}))
    msg = str(info.value)
    assert "'thing'" in msg and "options.size" in msg and "options.colour" in msg


def test_store_opens_and_validates_results(tmp_path: Path) -> None:
    with _install(tmp_path, GOOD):
        with hc.open_store(hc.StorageConfig(backend="thing", options={"size": 3})) as store:
            assert store.options.size == 3
            assert store.batch_io_v1("exists", ["a.b"]) == [False]
            assert store.batch_io_v1("exists", []) == []
            with pytest.raises(hc.BatchShapeError):
                store.batch_io_v1("get", ["a", "b"], [])
            with pytest.raises(hc.OperationNotSupportedError):
                store.batch_io_v2("exists", [])
            with pytest.raises(hc.PoolError):
                store.page_keys("kv", ["ab"])


def test_wrong_result_shapes_are_contract_errors(tmp_path: Path) -> None:
    for body, needle in (
        ("return None", "returned None"),
        ("return [True]", "exactly 2 bools"),
        ("return [1, 0]", "exactly 2"),
    ):
        src = GOOD.replace("return [False] * len(keys)", body)
        with _install(
            tmp_path / body.replace(" ", "_").replace("[", "").replace("]", "").replace(",", ""), src
        ):
            with hc.open_store(hc.StorageConfig(backend="thing")) as store:
                with pytest.raises(hc.BackendContractError, match=needle.split()[0]):
                    store.batch_io_v1("exists", ["a", "b"])


def test_clear_returning_none_is_a_contract_error(tmp_path: Path) -> None:
    source = (
        GOOD
        + """
    @hookimpl
    def hicache_clear(self, namespace):
        self.cleared = namespace
"""
    )
    with _install(tmp_path, source):
        with hc.open_store(hc.StorageConfig(backend="thing")) as store:
            with pytest.raises(hc.BackendContractError) as info:
                store.clear()
            backend = store.backend
    assert "hicache_clear returned None" in str(info.value) and "number of objects" in str(info.value)
    # the rule: the bare namespace is passed; keys start with namespace + "."
    assert backend.cleared == store.keys.scheme.namespace and not backend.cleared.endswith(".")


@pytest.mark.parametrize(
    ("result", "ok"), [("3", True), ("0", True), ("-1", False), ("True", False), ("'3'", False)]
)
def test_clear_result_must_be_a_count(tmp_path: Path, result: str, ok: bool) -> None:
    source = (
        GOOD
        + f"""
    @hookimpl
    def hicache_clear(self, namespace):
        return {result}
"""
    )
    with _install(tmp_path, source):
        with hc.open_store(hc.StorageConfig(backend="thing")) as store:
            if ok:
                assert store.clear() == int(result)
            else:
                with pytest.raises(hc.BackendContractError, match="int >= 0"):
                    store.clear()
