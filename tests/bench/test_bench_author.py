"""``hicache bench`` on a plugin made from CONTRIBUTING.md, as its author runs it.

The plugin is the guide's template with its path option renamed ``path``. The bench must take its
config from ``--config FILE``, ``HICACHE_CONFIG`` or ``HICACHE_BACKEND``/``HICACHE_OPTIONS`` like
every entry point, and leave nothing behind in the temporary directory (``TMPDIR`` points at an
empty folder of the test's own) whatever the option is called.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.helpers import subprocess_env, write_dist

REPO = Path(__file__).resolve().parents[2]
TEMPLATE_RE = re.compile(r"<!-- template: (?P<path>[^ ]+) -->\n```[a-z]*\n(?P<body>.*?)```", re.S)


def template_with_path_option() -> str:
    """The guide's backend module, its ``root`` option renamed ``path`` (still typed ``Path``)."""
    guide = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    body = {m["path"]: m["body"] for m in TEMPLATE_RE.finditer(guide)}[
        "hicache-example/hicache_example/__init__.py"
    ]
    assert "root: Path | None = None" in body and "options.root" in body
    return body.replace("root: Path | None", "path: Path | None").replace("options.root", "options.path")


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("example-site")
    return write_dist(
        site,
        "hicache-example",
        {"example": "hicache_example:ExampleBackend"},
        {"hicache_example": template_with_path_option()},
    )


def _bench(site: Path, tmpdir: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    full_env = {k: v for k, v in subprocess_env(site).items() if not k.startswith("HICACHE_")}
    full_env.update(TMPDIR=str(tmpdir), **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_core.cli", "bench", "--pages", "2", "--repeat", "1", "--json", *args],
        capture_output=True, text=True, timeout=300, env=full_env, check=False, cwd=tmpdir.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    assert report["verified"] is True, report["problems"]
    return report


def test_bench_config_file_with_a_path_option_leaves_nothing_behind(
    example_site: Path, tmp_path: Path
) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    config = tmp_path / "its.toml"
    config.write_text('backend = "example"\n\n[options]\n\n[controller]\nio_threads = 3\n')
    report = _bench(example_site, tmpdir, "--config", str(config))
    assert report["backend"] == "example" and report["io_threads"] == 3  # the file's settings
    assert report["config"] == f"config {config}"
    assert "os.write" in report["baseline"]  # raw files next to the `path` option, not memcpy
    cleanup = report["cleanup"]
    assert cleanup["left_behind"] is False and isinstance(cleanup["cleared"], int) and cleanup["cleared"] > 0
    assert [Path(p).name for p in cleanup["temp_paths"]] == ["hicache-path"]
    assert sorted(os.listdir(tmpdir)) == []  # nothing left: no temp root, no raw files, no default dir


def test_bench_reads_hicache_environment(example_site: Path, tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    store = tmp_path / "store"  # the user's own storage: kept, but the bench's namespace is cleared
    env = {"HICACHE_BACKEND": "example", "HICACHE_OPTIONS": json.dumps({"path": str(store)})}
    report = _bench(example_site, tmpdir, env=env)
    assert report["backend"] == "example" and report["config"] == "HICACHE_* environment"
    assert report["cleanup"]["temp_paths"] == [] and report["cleanup"]["left_behind"] is False
    assert store.is_dir() and list(store.iterdir()) == []  # every page of the bench's namespace is gone
    assert sorted(os.listdir(tmpdir)) == []  # the raw baseline went next to `path`, and was removed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hicache-bench-raw-")]


def test_bench_hicache_config_variable_and_command_line_override(example_site: Path, tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    config = tmp_path / "its.yaml"
    config.write_text("backend: file\noptions:\n  fsync: false\n")
    report = _bench(example_site, tmpdir, "--backend", "example", env={"HICACHE_CONFIG": str(config)})
    assert report["backend"] == "example"  # --backend wins; the file backend's options are dropped
    assert report["config"] == f"config {config} + command line"
    assert sorted(os.listdir(tmpdir)) == []


NONE_CLEAR = """
from hicache_core import hookimpl
from tests.support.membackend import MemoryBackend


class NoneClear(MemoryBackend):
    '''Clears, but forgets to return the count.'''

    @hookimpl
    def hicache_clear(self, namespace):
        MemoryBackend.hicache_clear(self, namespace)
"""


def test_bench_reports_a_clear_that_breaks_the_contract(tmp_path: Path, memory_backends: list[str]) -> None:
    from hicache_core.bench.runner import BenchRequest, run_bench
    from tests.support.distinfo import installed_dist

    with installed_dist(
        tmp_path / "site",
        "hicache-none-clear",
        {"hicache.backends": {"none-clear": "bench_none_clear:NoneClear"}},
        {"bench_none_clear": NONE_CLEAR},
    ):
        report = run_bench(BenchRequest(backend="none-clear", options={}, pages=4, rounds=1, progress=False))
    assert report["verified"] is True  # the bytes were fine; the clean-up is reported apart
    cleanup = report["cleanup"]
    assert cleanup["left_behind"] is True and cleanup["temp_paths"] == []
    assert "hicache_clear returned None" in cleanup["note"]
    report = run_bench(BenchRequest(backend="memory", options={}, pages=4, rounds=1, progress=False))
    assert report["cleanup"]["left_behind"] is False and report["cleanup"]["cleared"] > 0
