"""Option values: ``root``'s ``$VARS`` (an unset variable is an error naming it, never a directory
literally called ``$VAR`` under the working directory); sizes refuse booleans."""

from __future__ import annotations

import importlib

import pytest

import hicache_core as hc


@pytest.mark.parametrize("module", ["hicache_file._options", "hicache_nixl._options"])
def test_root_variables(module: str, tmp_path, monkeypatch) -> None:
    options = (
        importlib.import_module(module) if module == "hicache_file._options" else pytest.importorskip(module)
    )
    cls = options.FileOptions if module == "hicache_file._options" else options.NixlOptions
    monkeypatch.setenv("HC_OPTIONS_TEST_ROOT", str(tmp_path))
    monkeypatch.delenv("HC_OPTIONS_TEST_UNSET", raising=False)
    assert cls(root="$HC_OPTIONS_TEST_ROOT/c").root == str(tmp_path / "c")
    assert cls(root="${HC_OPTIONS_TEST_ROOT}/d").root == str(tmp_path / "d")
    for bad in ("$HC_OPTIONS_TEST_UNSET/c", "${HC_OPTIONS_TEST_UNSET}/c"):
        with pytest.raises(ValueError, match="HC_OPTIONS_TEST_UNSET is not set"):
            cls(root=bad)
    monkeypatch.chdir(tmp_path)
    cfg = hc.StorageConfig(backend="file", options={"root": "$HC_OPTIONS_TEST_UNSET/cache"})
    with pytest.raises(hc.OptionsError, match="HC_OPTIONS_TEST_UNSET is not set"):
        hc.open_store(cfg)
    assert not list(tmp_path.glob("$*")), "a directory named after the unset variable was created"


@pytest.mark.parametrize("value", [True, False])
def test_sizes_refuse_booleans(value: bool) -> None:
    from hicache_file._options import FileOptions

    with pytest.raises(ValueError, match="a size must be bytes"):
        FileOptions(max_bytes=value)
    assert FileOptions(max_bytes="1KiB").max_bytes == 1024
