"""``vllm serve --kv-transfer-config`` with the connector: the OpenAI-compatible server on
127.0.0.1 answers one completion request twice; the second reports cached prompt tokens.

vLLM's own prefix cache is off (``--no-enable-prefix-caching``), so every cached token of the
second request comes from the hicache store.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tiny_model import BLOCK, PROMPTS

# the engines start in fresh processes: minutes on a loaded 2-core machine
pytestmark = pytest.mark.timeout(900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def test_vllm_serve_with_kv_transfer_config(tiny_models: list[Path], tmp_path: Path) -> None:
    port = _free_port()
    transfer = {
        "kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache_vllm",
        "kv_role": "kv_both",
        # saves on the save thread, loads in the default (synchronous) mode
        "kv_connector_extra_config": {
            "backend": "file",
            "options": {"root": str(tmp_path / "store")},
            "async_save": True,
        },
    }
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("vllm_cli.py")),  # the `vllm` command (see that file)
            "serve",
            str(tiny_models[0]),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--enforce-eager",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "1024",
            "--dtype",
            "bfloat16",
            "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(transfer),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"vllm serve exited ({proc.returncode}):\n{(tmp_path / 'serve.log').read_text()[-6000:]}"
                )
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready:\n{(tmp_path / 'serve.log').read_text()[-6000:]}")
            time.sleep(1)
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        first = _post(base + "/v1/completions", body)
        # the saves run on the save thread and may end after the response: wait for the 6 pages
        pages: list[Path] = []
        deadline = time.monotonic() + 60
        while len(pages) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
            pages = [p for p in (tmp_path / "store").rglob("*.kv.*") if p.is_file()]
        assert len(pages) == 6, f"pages stored after the first request: {pages}"
        second = _post(base + "/v1/completions", body)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    cached = [
        (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for r in (first, second)
    ]
    assert cached[0] == 0
    assert cached[1] == 6 * BLOCK, f"usage: {second['usage']}"
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert first["usage"]["prompt_tokens"] == 200
