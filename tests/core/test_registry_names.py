"""A backend named as its user thinks of it (other case, the distribution's name) gets a
"did you mean", and never a suggestion to install something."""

from __future__ import annotations

import pytest

import hicache_core as hc


@pytest.mark.parametrize("name", ["FILE", "File", "hicache-file", "hicache_file", "fiel"])
def test_did_you_mean_the_backend(name: str) -> None:
    with pytest.raises(hc.BackendNotFoundError, match="Did you mean 'file'") as info:
        hc.load_backend_class(name)
    assert isinstance(info.value, LookupError)
    assert "pip install" not in str(info.value)


def test_cli_version() -> None:
    import subprocess
    import sys
    from importlib.metadata import version

    proc = subprocess.run(
        [sys.executable, "-m", "hicache_core.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"hicache {version('hicache-core')}", proc
