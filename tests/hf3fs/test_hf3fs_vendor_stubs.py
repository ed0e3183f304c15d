"""eic / simm: declared and listed, never opened without their vendor SDK; the CLI view.

``nixl`` left this distribution for its own (``hicache-nixl``); the listing must name it once, there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf3fs_util import REPO, _cli_env, cli_backends_result
from hicache_hf3fs_stub import vendor
from hicache_hf3fs_stub.vendor import EicBackend, SimmBackend, VendorSdkBackend

from hicache_core import (
    BackendUnavailableError,
    DraftIoMode,
    KeyFormatError,
    PoolName,
    PoolTransfer,
    StorageConfig,
    open_store,
)
from hicache_core.plugin.registry import load_backend_class

VENDORS = {"eic": EicBackend, "simm": SimmBackend}
SDK_WORDS = {"eic": "EIC", "simm": "SiMM"}
HICACHE = Path(sys.executable).with_name("hicache")


@pytest.mark.parametrize("name", sorted(VENDORS))
def test_entry_point_resolves_to_the_declared_class(name: str) -> None:
    cls = load_backend_class(name)
    assert cls is VENDORS[name] and issubclass(cls, VendorSdkBackend)
    assert cls.backend_name == name
    assert cls.capabilities.draft_io is DraftIoMode.UNSUPPORTED
    assert PoolName.DRAFT not in cls.capabilities.pools


@pytest.mark.parametrize("name", sorted(VENDORS))
def test_opening_raises_unavailable_naming_the_sdk_and_install(name: str) -> None:
    cls = VENDORS[name]
    assert not cls.sdk_installed(), f"{cls.sdk_module} is importable here; these tests assume no vendor SDK"
    reason = cls.availability()
    assert reason.startswith("needs the vendor SDK (") and SDK_WORDS[name] in reason and "install" in reason
    with pytest.raises(BackendUnavailableError) as err:
        open_store(StorageConfig(backend=name))
    assert str(err.value) == f"backend {name!r} cannot run here: {reason}"
    # no code path stores data: direct construction and every hook refuse the same way
    with pytest.raises(BackendUnavailableError, match="vendor SDK"):
        cls(StorageConfig(backend=name), cls.Options())
    with pytest.raises(BackendUnavailableError, match="vendor SDK"):
        VendorSdkBackend.hicache_batch_io_v1.__get__(object.__new__(cls))(op="get", keys=["k"], buffers=[])


def test_the_classes_share_one_implementation() -> None:
    for cls in VENDORS.values():
        own = {k for k, v in vars(cls).items() if callable(v) or isinstance(v, classmethod)}
        assert not own, f"{cls.__name__} re-implements {own}; keep the behaviour in VendorSdkBackend"


def test_sdk_present_but_no_transport_is_still_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SimmBackend, "sdk_module", "json")  # any importable module
    reason = SimmBackend.availability()
    assert "is installed" in reason and "install a full simm hicache plugin" in reason


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HICACHE), *args], capture_output=True, text=True, timeout=120, cwd=REPO, env=_cli_env()
    )


def test_cli_backends_json_lists_hf3fs_and_the_sdk_backends() -> None:
    # `.venv/bin/hicache backends --json` in a subprocess, started when collection finished
    code, out, err = cli_backends_result()
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    hf3fs = rows["hf3fs"]
    assert hf3fs["distribution"] == "hicache-hf3fs-stub" and hf3fs["status"] == "ok"
    assert (hf3fs["v1"], hf3fs["v2"], hf3fs["zero_copy"]) == (True, False, False)
    assert hf3fs["draft_io"] == "unsupported" and hf3fs["persistent"] is True
    for name, cls in VENDORS.items():
        row = rows[name]
        assert row["distribution"] == "hicache-hf3fs-stub"
        assert row["status"] == f"unavailable: {cls.availability()}"
        assert row["status"].startswith("unavailable: needs the vendor SDK (")
        assert row["draft_io"] == "unsupported"
        assert row["capabilities"] == cls.capabilities.as_dict()
    # nixl moved to its own distribution: listed once, from there (when it is installed)
    assert not hasattr(vendor, "NixlBackend")
    if "nixl" in rows:
        assert rows["nixl"]["distribution"] == "hicache-nixl"
    assert sum(r["name"] == "nixl" for r in json.loads(out)) <= 1


def test_cli_check_simm_fails_with_the_sdk_message_and_no_traceback() -> None:
    proc = _cli("check", "simm")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    if "not implemented" in proc.stderr + proc.stdout:
        pytest.skip("`hicache check` is still a placeholder in the core")
    assert "needs the vendor SDK" in proc.stderr + proc.stdout


class _SubclassKey(str):
    pass


@pytest.mark.parametrize("name", sorted(VENDORS))
@pytest.mark.parametrize("bad", ["../etc/passwd", "a/b", "a\0b", _SubclassKey("ns.kv.k.tp0of1.x"), b"k"])
def test_io_hooks_check_keys_before_refusing(name: str, bad: object) -> None:
    backend = object.__new__(VENDORS[name])
    with pytest.raises(KeyFormatError):
        backend.hicache_batch_io_v1(op="set", keys=["ns.kv.k.tp0of1.ok", bad], buffers=[])
    if VENDORS[name].capabilities.v2:
        transfer = PoolTransfer(PoolName.KV, (0,), ("h",), keys=(("ns.kv.k.tp0of1.ok", bad),))  # type: ignore[arg-type]
        with pytest.raises(KeyFormatError):
            backend.hicache_batch_io_v2(op="set", transfers=[transfer])
    with pytest.raises(KeyFormatError):
        backend.hicache_batch_io_v1(op="get", keys="ns.kv.k.tp0of1.ok", buffers=[])  # one str is not a batch
