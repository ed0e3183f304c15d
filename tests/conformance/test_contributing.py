"""CONTRIBUTING.md cannot drift from the code: hook signatures, test names, and the template.

The template test follows the guide literally: it writes every code block marked
``<!-- template: PATH -->`` into an empty folder, installs the resulting distribution with pip
into a throwaway ``--target`` directory and runs ``hicache check example`` on it (and the
template's own ``BackendConformance`` subclass) in subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_core.testing import BackendConformance, hookspec_signatures
from tests.conformance.helpers import subprocess_env, write_dist

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "CONTRIBUTING.md"
TEMPLATE_RE = re.compile(r"<!-- template: (?P<path>[^ ]+) -->\n```[a-z]*\n(?P<body>.*?)```", re.S)


def _guide() -> str:
    return GUIDE.read_text(encoding="utf-8")


def _templates() -> dict[str, str]:
    return {m["path"]: m["body"] for m in TEMPLATE_RE.finditer(_guide())}


@pytest.mark.parametrize("hook", list(hookspec_signatures()))
def test_hook_signature_documented(hook: str) -> None:
    signature = hookspec_signatures()[hook]
    assert signature in _guide(), f"CONTRIBUTING.md must quote the hookspec exactly:\n{signature}"


def test_every_suite_test_documented() -> None:
    guide = _guide()
    names = sorted(n for n in dir(BackendConformance) if n.startswith("test_"))
    assert len(names) >= 40
    missing = [n for n in names if f"`{n}`" not in guide and f"`{n}[" not in guide]
    assert not missing, f"tests missing from CONTRIBUTING.md section 1.7: {missing}"


def test_template_blocks_present() -> None:
    paths = set(_templates())
    assert {
        "hicache-example/pyproject.toml",
        "hicache-example/hicache_example/__init__.py",
        "hicache-example/tests/test_conformance.py",
    } <= paths, paths


def _hicache() -> list[str]:
    script = Path(sys.executable).with_name("hicache")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hicache_core.cli"]


V1_SIGNATURE = "buffers: Sequence[torch.Tensor] | None, pool_name: PoolName\n"
LEGACY_V1_SIGNATURE = "buffers: Sequence[torch.Tensor] | None\n"


@pytest.mark.parametrize("v1_signature", ["current", "without_pool_name"])
def test_template_installs_and_certifies(tmp_path: Path, v1_signature: str) -> None:
    """Empty folder -> template files -> pip install -> `hicache check example` exits 0.

    ``without_pool_name``: the template's ``hicache_batch_io_v1`` written against the hookspec
    before it had ``pool_name`` still loads and certifies (pluggy passes arguments by name).
    """
    for rel, body in _templates().items():
        if v1_signature == "without_pool_name" and rel.endswith("__init__.py"):
            assert V1_SIGNATURE in body
            body = body.replace(V1_SIGNATURE, LEGACY_V1_SIGNATURE)
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    target = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-input",
         "--disable-pip-version-check", "-q", "--target", str(target), str(tmp_path / "hicache-example")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert pip.returncode == 0, f"pip install failed:\n{pip.stdout[-3000:]}\n{pip.stderr[-3000:]}"
    assert list(target.glob("hicache_example-*.dist-info")), sorted(p.name for p in target.iterdir())
    env = dict(os.environ, PYTHONPATH=str(target))
    env.pop("PYTEST_ADDOPTS", None)
    work = tmp_path / "work"
    work.mkdir()
    check = subprocess.run(
        [*_hicache(), "check", "example", "-q", "--json", str(work / "check.json")], cwd=work, env=env,
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    output = check.stdout + check.stderr
    assert check.returncode == 0, f"hicache check example failed:\n{output[-6000:]}"
    assert "PASSED" in output and "0 failed" in output, output[-3000:]
    passed = int(re.search(r"(\d+) passed, 0 failed", output)[1])  # type: ignore[index]
    assert passed >= 40, output[-3000:]
    result = json.loads((work / "check.json").read_text())
    assert result["verdict"] == "passed" and result["totals"]["passed"] == passed
    assert result["distribution"] == "hicache-example"
    for group in ("mamba", "indexer", "draft"):  # the template claims every pool, explicitly
        assert f"pools={group}" not in json.dumps(result["groups"]), result["groups"]
    tests_dir = tmp_path / "hicache-example" / "tests"
    sub = subprocess.run(
        [sys.executable, "-m", "pytest", str(tests_dir / "test_conformance.py"), "-q", "-p", "no:cacheprovider",
         "--rootdir", str(tests_dir), "-o", "addopts=", "-k", "discovery or contract or v1_roundtrip"],
        cwd=tests_dir, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert sub.returncode == 0, f"the template's BackendConformance subclass failed:\n{sub.stdout[-4000:]}"


EXAMPLE_RE = re.compile(r"<!-- example: (?P<path>[^ ]+) -->\n```[a-z]*\n(?P<body>.*?)```", re.S)


def test_copying_v2_example_certifies(tmp_path: Path) -> None:
    """The guide's "v2 for a copying backend" example, saved where the guide says (``hicache_example/v2.py``,
    inside the package the template's ``packages`` ships), passes the v1, v2, pools and draft tests."""
    examples = {m["path"]: m["body"] for m in EXAMPLE_RE.finditer(_guide())}
    site = write_dist(
        tmp_path / "site",
        "hicache-example-v2",
        {"example-v2": "hicache_example.v2:ExampleV2Backend"},
        {
            "hicache_example/__init__": _templates()["hicache-example/hicache_example/__init__.py"],
            "hicache_example/v2": examples["hicache_example/v2.py"],
        },
    )
    out = tmp_path / "v2.json"
    check = subprocess.run(
        [*_hicache(), "check", "example-v2", "-q", "--json", str(out), "--", "-k", "v1 or v2 or pools or draft"],
        cwd=tmp_path, env=subprocess_env(site), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout[-6000:] + check.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["verdict"] == "passed", result["groups"]
    v2 = result["groups"]["v2"]
    assert v2["passed"] > 0 and not [r for r in v2["skip_reasons"] if "capabilities.v2" in r], v2
    assert result["groups"]["pools"]["passed"] > 0 and result["groups"]["draft"]["passed"] > 0


def test_guide_states_the_namespace_rule_the_core_follows() -> None:
    """One rule for hicache_clear: the bare namespace is passed; keys start with namespace + ".".

    The dot matters: a namespace can be a string prefix of another one (a model named after it),
    so a prefix match without the dot would clear the other model's pages too.
    """
    import hicache_core as hc
    from hicache_core.paging.keys import KeyScheme

    guide = _guide()
    assert 'starts with `namespace + "."`' in guide and "without a trailing `.`" in guide
    a = KeyScheme(hc.StorageConfig(model_name="m"))
    b = KeyScheme(hc.StorageConfig(model_name=a.namespace + "-x"))
    assert not a.namespace.endswith(".")
    for scheme in (a, b):
        (prefix,) = scheme.prefixes(hc.PoolName.KV, ["k"], replicated=False)
        assert prefix.startswith(scheme.namespace + ".")
    (b_prefix,) = b.prefixes(hc.PoolName.KV, ["k"], replicated=False)
    assert b_prefix.startswith(a.namespace) and not b_prefix.startswith(a.namespace + ".")
