"""``hicache check nixl``: the whole conformance suite, as an operator runs it, on both plugins.

* POSIX plugin: files under a temporary root (the suite gives ``root`` a fresh path per test);
* POSIX plugin with ``O_DIRECT`` and io_uring: the tests of the transfer path (``IO_TESTS``);
* OBJ plugin: against a real S3-compatible server (moto) on 127.0.0.1, in a bucket this test
  created, credentials in the environment only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from nixl_util import S3Server

REPO = Path(__file__).resolve().parents[2]
HICACHE = Path(sys.executable).with_name("hicache")


def _check(tmp_path: Path, options: dict[str, Any], *pytest_args: str) -> dict[str, Any]:
    out = tmp_path / "check.json"
    cmd = [str(HICACHE), "check", "nixl", "--options", json.dumps(options), "--json", str(out)]
    if pytest_args:
        cmd += ["--", *pytest_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=dict(os.environ))
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["verdict"] == "passed", tail
    assert result["totals"]["failed"] == 0 and result["totals"]["passed"] > 0, result["totals"]
    return result


def test_check_posix_passes(tmp_path: Path) -> None:
    result = _check(tmp_path, {"plugin": "posix"})
    assert result["totals"]["passed"] >= 90, result["totals"]


# O_DIRECT and io_uring change only how bytes move: the transfer tests (all sizes, both layouts,
# every pool of v2), exact bytes, size mismatches and torn pages (1 MiB components, O_DIRECT)
IO_TESTS = "roundtrip or layer_first or v2_kv or v2_draft or bytes_exact or size_mismatch or no_torn"


def test_check_posix_o_direct_uring_io_tests_pass(tmp_path: Path) -> None:
    result = _check(tmp_path, {"plugin": "posix", "o_direct": True, "engine": "uring"}, "-k", IO_TESTS)
    assert result["totals"]["passed"] >= 20, result["totals"]


def test_check_obj_against_a_local_s3_server_passes(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    result = _check(tmp_path, s3_server.options(s3_bucket))
    assert result["totals"]["passed"] >= 90, result["totals"]
    assert "secret" not in json.dumps(result).lower()  # option names only, and no credential was an option
