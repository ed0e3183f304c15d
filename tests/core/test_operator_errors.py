"""What an operator sees: secrets never echoed, allow / block lists that fail safe, one rule for
optional variables and for merging config sources, typed sizing errors, CLI failures as one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hicache_core as hc
from hicache_core.cli.command import main
from hicache_core.plugin import registry
from hicache_core.sizing import decode_mamba_pool_size, standalone_required_bytes

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
HICACHE = [sys.executable, "-m", "hicache_core.cli"]


# ------------------------------------------------------------------ secrets in errors
@pytest.mark.parametrize("key", ["aws_secret_access_key", "nope", "Password"])
def test_unknown_option_value_is_never_shown(key: str, tmp_path: Path) -> None:
    with pytest.raises(hc.OptionsError) as err:
        hc.open_store(hc.StorageConfig(backend="file", options={"root": str(tmp_path), key: SECRET}))
    assert f"options.{key}" in str(err.value) and SECRET not in str(err.value)


def test_options_from_the_environment_are_not_echoed(tmp_path: Path) -> None:
    env = {"HICACHE_OPTIONS": f'{{"root": "{tmp_path}", "secret_key": "{SECRET}"}}'}
    with pytest.raises(hc.OptionsError) as err:
        hc.open_store(hc.load_config(environ=env))
    assert "secret_key" in str(err.value) and SECRET not in str(err.value)


def test_secret_named_field_and_url_userinfo_are_masked() -> None:
    from pydantic import BaseModel, ConfigDict, ValidationError

    from hicache_core.config import format_validation_error

    class Opts(BaseModel):
        model_config = ConfigDict(extra="forbid")
        api_token: int = 0
        endpoint: int = 0

    url = f"http://AKIAEXAMPLE:{SECRET}@host-with-a-long-name.example.com:9000/" + "p" * 200
    with pytest.raises(ValidationError) as err:
        Opts.model_validate({"api_token": SECRET, "endpoint": url})
    text = format_validation_error(err.value)
    assert "api_token" in text and "endpoint" in text and "http://***@host" in text
    assert SECRET not in text and "AKIAEXAMPLE" not in text


def test_config_repr_hides_credentials() -> None:
    cfg = hc.StorageConfig(
        backend="nixl", options={"endpoint": f"http://ak:{SECRET}@h:9000", "aws_secret": SECRET}
    )
    assert SECRET not in repr(cfg) and SECRET not in str(cfg) and "http://***@h:9000" in repr(cfg)
    assert cfg.options["aws_secret"] == SECRET  # only what is shown is masked


# ------------------------------------------------------------------ allow / block lists
@pytest.fixture
def fresh_registry() -> None:
    registry.clear_caches()  # also forgets which list entries were already warned about


@pytest.mark.parametrize("block", ["FILE", " File ", "*", "mooncake,*"])
def test_block_list_matches_in_any_case_and_star_blocks_all(block: str, fresh_registry: None) -> None:
    assert "file" not in hc.find_backends(environ={"HICACHE_BACKENDS_BLOCK": block})
    with pytest.raises(hc.BackendNotFoundError, match="disabled by"):
        hc.load_backend_class("file", environ={"HICACHE_BACKENDS_BLOCK": block})


def test_allow_list_matches_in_any_case(fresh_registry: None) -> None:
    assert list(hc.find_backends(environ={"HICACHE_BACKENDS_ALLOW": "File"})) == ["file"]
    assert "file" in hc.find_backends(environ={"HICACHE_BACKENDS_ALLOW": "*"})


@pytest.mark.parametrize("var", ["HICACHE_BACKENDS_BLOCK", "HICACHE_BACKENDS_ALLOW"])
def test_list_entry_naming_nothing_is_a_warning(
    var: str, fresh_registry: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="hicache"):
        hc.find_backends(environ={var: "fiel"})
        hc.find_backends(environ={var: "fiel"})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once per entry, not per lookup
    assert var in warnings[0] and "'fiel'" in warnings[0] and "did you mean 'file'" in warnings[0]


def test_missing_extension_message_grammar() -> None:
    with pytest.raises(hc.BackendNotFoundError, match="An extension is a distribution"):
        registry.load_extension_class("nosuchext")


# ------------------------------------------------------------------ optional variables
@pytest.mark.parametrize("raw", ["", "none", "None", " NONE "])
@pytest.mark.parametrize("var", ["HICACHE_MODEL_REVISION", "HICACHE_IO_TIMEOUT_S"])
def test_optional_variables_none_or_empty_mean_unset(var: str, raw: str) -> None:
    cfg = hc.load_config(environ={var: raw})
    assert cfg.model_revision is None and cfg.controller.io_timeout_s is None


# ------------------------------------------------------------------ merging config sources
@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("dup.json", '{"model_name": "a", "model_name": "b"}'),
        ("dup.yaml", "model_name: a\nmodel_name: b\n"),
        ("nested.json", '{"options": {"model_name": 1, "model_name": 2}}'),
        ("nested.yml", "options:\n  model_name: 1\n  model_name: 2\n"),
    ],
)
def test_duplicate_keys_are_refused(name: str, text: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(hc.ConfigError, match=r"'model_name' appears twice") as err:
        hc.load_config(path, environ={})
    assert str(path) in str(err.value)


def test_yaml_merge_key_may_still_be_overridden(tmp_path: Path) -> None:
    from hicache_core.config import read_config_file

    path = tmp_path / "merge.yaml"
    path.write_text("controller:\n  <<: {io_threads: 3, batch_pages: 8}\n  batch_pages: 16\n")
    assert read_config_file(path)["controller"] == {"io_threads": 3, "batch_pages": 16}


def test_setting_given_flat_and_nested_in_one_source_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("batch_pages = 64\n[controller]\nbatch_pages = 32\n")
    with pytest.raises(hc.ConfigError, match=r"batch_pages is given twice.*64.*32") as err:
        hc.load_config(path, environ={})
    assert str(path) in str(err.value)
    with pytest.raises(hc.ConfigError, match="batch_pages is given twice"):
        hc.StorageConfig(batch_pages=1, controller={"batch_pages": 2})


def test_sources_merge_setting_by_setting_and_option_by_option(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[options]\nroot = "/a"\nfsync = true\n[controller]\nbatch_pages = 64\nio_threads = 3\n')
    env = {"HICACHE_BATCH_PAGES": "16", "HICACHE_OPTIONS": '{"root": "/b"}'}
    cfg = hc.load_config(path, environ=env, options={"max_bytes": "1GiB"}, controller={"io_threads": 4})
    assert cfg.options == {"root": "/b", "fsync": True, "max_bytes": "1GiB"}
    assert (cfg.controller.batch_pages, cfg.controller.io_threads) == (16, 4)
    other = hc.load_config(path, environ={}, backend="hf3fs", options={"x": 1})
    assert other.options == {"x": 1}  # the file's options belonged to another backend
    same = hc.StorageConfig.from_file(path, options={"fsync": False})
    assert same.options == {"root": "/a", "fsync": False}


def test_model_copy_updates_one_setting() -> None:
    cfg = hc.StorageConfig(controller={"io_threads": 3}).model_copy(update={"batch_pages": 7})
    assert (cfg.controller.batch_pages, cfg.controller.io_threads) == (7, 3)


# ------------------------------------------------------------------ sizing helpers
@pytest.mark.parametrize("buffer", [5, "kv", object()])
def test_standalone_sizing_refuses_a_buffer_that_is_not_a_tensor(buffer: object) -> None:
    with pytest.raises(hc.ArgumentTypeError, match="pool 'kv'"):
        standalone_required_bytes({"kv": SimpleNamespace(kv_buffer=buffer)})


def test_standalone_sizing_refuses_buffers_returning_none() -> None:
    with pytest.raises(hc.ArgumentTypeError, match=r"pool 'kv'.*buffers\(\)"):
        standalone_required_bytes({"kv": SimpleNamespace(buffers=lambda: None)})


def test_standalone_sizing_counts_overlapping_views_once() -> None:
    big = torch.empty(2, 64, dtype=torch.uint8)
    sglang_style = SimpleNamespace(kv_buffer=big, k_buffer=big[0], v_buffer=big[1])
    assert standalone_required_bytes({"kv": sglang_style}) == 128
    assert (
        standalone_required_bytes(
            {"kv": SimpleNamespace(kv_buffer=big), "draft": SimpleNamespace(kv_buffer=big[1:])}
        )
        == 128
    )
    strided = torch.empty(4, 8, dtype=torch.uint8)[:, :2]  # spans rows 0..3, first 2 bytes of each
    assert standalone_required_bytes({"kv": SimpleNamespace(kv_buffer=strided)}) == 3 * 8 + 2


@pytest.mark.parametrize("flag", ["extra_buffer", "overlap_schedule"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_decode_mamba_flags_must_be_bools(flag: str, value: object) -> None:
    kwargs = {"extra_buffer": False, "overlap_schedule": False, flag: value}
    with pytest.raises(hc.ArgumentTypeError, match=flag):
        decode_mamba_pool_size(8, 0, None, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------ metrics exporter
def test_bad_metrics_address_names_the_address_variable() -> None:
    pytest.importorskip("prometheus_client")
    from hicache_core.extensions.metrics import start_exporter

    with pytest.raises(hc.ConfigError, match="HICACHE_METRICS_ADDR") as err:
        start_exporter(0, "not an address")
    assert "choose another HICACHE_METRICS_PORT" not in str(err.value)


# ------------------------------------------------------------------ the command line
def test_count_flag_error_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--pages", "abc"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --pages: expected a positive integer" in err
    assert "_positive" not in err


def test_check_report_path_is_checked_before_the_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "file", "-q", "--junitxml", "/proc/no/x.xml"]) == 2
    err = capsys.readouterr().err
    assert "--junitxml: cannot write /proc/no/x.xml" in err and "Traceback" not in err


def _run(
    args: list[str], stdout: object = subprocess.PIPE, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    return subprocess.run(
        args, input=stdin, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300, env=env
    )


def test_pytest_usage_error_is_not_a_pass() -> None:
    proc = _run([*HICACHE, "check", "file", "-q", "--", "--nosuchflag"])
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "PASSED" not in proc.stdout and "pytest exited with code 4" in proc.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_write_failure_is_one_line() -> None:
    with open("/dev/full", "w") as full:
        proc = _run([*HICACHE, "backends", "--json"], stdout=full)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "hicache backends: error: No space left on device (writing standard output)"
    ]


def test_bench_verifier_starts_without_runpy_warning() -> None:
    proc = _run([sys.executable, "-m", "hicache_core.bench.verify"])
    assert "RuntimeWarning" not in proc.stderr and "found in sys.modules" not in proc.stderr, proc.stderr
