"""Mooncake object checksums (option ``checksum``): a corrupt object is a counted, removed miss.

Mooncake reads ``MOONCAKE_STORE_CHECKSUM`` once per process, when the first client is created,
so each case runs in a fresh interpreter (``checksum_worker.py``) against the session's real
``mooncake_master``; the bytes of stored objects are flipped in place (embedded mode: the
segment is the worker's own memory). Both workers run at the same time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hicache_mooncake import MooncakeBackend, MooncakeOptions
from hicache_mooncake._options import checksum_enabled
from hicache_mooncake.testing import MooncakeMaster

from hicache_core import OptionsError
from hicache_core.plugin.store import validate_options

WORKER = Path(__file__).with_name("checksum_worker.py")


@pytest.fixture(scope="module")
def results(mooncake_master: MooncakeMaster) -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_STORE_CHECKSUM"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = {
        mode: subprocess.Popen(
            [sys.executable, str(WORKER), mooncake_master.address, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in ("on", "off")
    }
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=150)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        assert proc.returncode == 0 and lines, f"worker {mode} failed ({proc.returncode}):\n{stderr[-4000:]}"
        out[mode] = json.loads(lines[-1])
    return out


def test_checksum_option_sets_the_process_environment(results: dict[str, dict[str, Any]]) -> None:
    on, off = results["on"], results["off"]
    assert on["env_before"] is None and on["env_after_open"] == "1" and on["process_checksum"] is True
    assert off["env_before"] is None and off["env_after_open"] is None and off["process_checksum"] is False


def test_corrupt_objects_are_counted_logged_removed_and_rewritten(results: dict[str, dict[str, Any]]) -> None:
    v2 = results["on"]["v2"]
    n, victims = v2["pages"], v2["victims"]
    assert [i for i in range(n) if not v2["got"][i]] == victims  # exactly the damaged pages miss
    assert v2["returned_as_data"] == []
    assert v2["integrity_errors"] == len(victims) == v2["metric_integrity_errors"]
    assert len(v2["warned_keys"]) == len(victims)  # one WARNING naming each corrupt key
    assert [i for i in range(n) if not v2["exists_after"][i]] == victims  # removed: not reported
    # the next backup rewrites exactly the damaged pages; then every page reads back exactly
    assert v2["backup_pages"] == n and v2["rewritten"] == len(victims)
    assert v2["healed_pages"] == n and v2["healed_exact"]
    assert v2["integrity_errors_end"] == len(victims)  # the counter only grows on new failures


def test_strided_v1_reads_are_checked_too(results: dict[str, dict[str, Any]]) -> None:
    v1 = results["on"]["v1"]
    assert v1["flags"] == [True, True, True, True, True, False, True, True]  # page 2, component V
    assert v1["integrity_errors"] == 1
    assert v1["exists_after"] == [True, True, True, True, True, False, True, True]


def test_without_checksums_corruption_is_invisible(results: dict[str, dict[str, Any]]) -> None:
    """The default (off): Mooncake returns the damaged bytes; nothing can count them."""
    v2 = results["off"]["v2"]
    assert all(v2["got"]) and v2["returned_as_data"] == v2["victims"]
    assert v2["integrity_errors"] == 0 and v2["metric_integrity_errors"] == 0


def test_other_setting_in_the_same_process_warns(results: dict[str, dict[str, Any]]) -> None:
    assert results["on"]["mismatch_warning"] and results["off"]["mismatch_warning"]


def test_checksum_option_default_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_STORE_CHECKSUM", raising=False)
    assert MooncakeOptions().checksum is False
    for value, want in [("1", True), ("TRUE", True), ("on", True), ("0", False), ("off", False)]:
        monkeypatch.setenv("MOONCAKE_STORE_CHECKSUM", value)
        assert MooncakeOptions().checksum is want and checksum_enabled(value) is want
        assert MooncakeOptions(load_env=False).checksum is False
    monkeypatch.setenv("MOONCAKE_STORE_CHECKSUM", "y")  # pydantic's bool, but not Mooncake's
    with pytest.raises(OptionsError, match="MOONCAKE_STORE_CHECKSUM"):
        validate_options(MooncakeBackend, "mooncake", {})
