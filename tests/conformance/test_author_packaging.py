"""A plugin author's venv sees the core the way static tools need it.

``pip install -e path/to/hicache`` must put a plain path in its ``.pth`` file: setuptools' default
for a flat layout is an import-hook finder (``__editable___*_finder.py``) that mypy cannot follow
("Cannot find implementation or library stub for module named 'hicache_core'"). The core's
``pyproject.toml`` sets ``package-dir = {"" = "."}`` for that; this builds the editable wheel of
a copy of it (with setuptools' own PEP 660 hook, no network) and reads the ``.pth``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("pyproject", ["core", "template"])
def test_editable_install_is_a_plain_path(tmp_path: Path, pyproject: str) -> None:
    project = tmp_path / "project"
    if pyproject == "core":
        package = project / "hicache_core"
        package.mkdir(parents=True)
        shutil.copy(REPO / "pyproject.toml", project / "pyproject.toml")
        (project / "README.md").write_text("readme\n")
    else:  # the CONTRIBUTING.md template's pyproject.toml
        from tests.conformance.test_contributing import _templates

        package = project / "hicache_example"
        package.mkdir(parents=True)
        (project / "pyproject.toml").write_text(_templates()["hicache-example/pyproject.toml"])
    (package / "__init__.py").write_text('"""package"""\n')
    (package / "py.typed").write_text("")
    code = "import sys, setuptools.build_meta as b; print(b.build_editable(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "wheel")],
        cwd=project, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (pth,) = [n for n in names if n.endswith(".pth")]
        lines = z.read(pth).decode().split()
    assert lines == [str(project)], f"{pth} must hold the project folder, not an import hook: {lines}"
    assert not [n for n in names if n.endswith("_finder.py")], names
