#!/usr/bin/env bash
# Set up a development environment in .venv/ at the repository root (idempotent).
#   - system: libibverbs1 (needed by the Mooncake store) and libssl-dev (the OpenSSL headers the
#     core's native page hashing builds against), installed with apt-get when missing and we are root
#   - python: torch 2.13.0 (CPU wheel), the core with its dev extra and every plugin in plugins/, editable
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing libibverbs1 (needed by mooncake-transfer-engine)"
    (apt-get install -y -q libibverbs1 >/dev/null 2>&1) || (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null)
  else
    echo "setup: WARNING libibverbs1 is missing; install it (apt-get install libibverbs1) for the mooncake plugin" >&2
  fi
fi

if [ ! -f /usr/include/openssl/evp.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing libssl-dev (OpenSSL headers for the native page hashing)"
    (apt-get install -y -q libssl-dev >/dev/null 2>&1) || (apt-get update -q >/dev/null && apt-get install -y -q libssl-dev >/dev/null)
  else
    echo "setup: WARNING OpenSSL headers are missing; install them (apt-get install libssl-dev) to build the native page hashing" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# The core's C page hashing must build here: a silent
# fallback to pure Python would hide a broken toolchain behind slower numbers.
export HICACHE_REQUIRE_NATIVE=${HICACHE_REQUIRE_NATIVE:-1}
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" -U pip setuptools wheel
# Pin the CPU build: a bare `torch` requirement would pull a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
editables=(-e ".[dev]")
for plugin in plugins/*/ integrations/*/; do
  [ -f "$plugin/pyproject.toml" ] || continue
  if [ -f "$plugin/.dev-extras" ]; then
    editables+=(-e "${plugin%/}[$(cat "$plugin/.dev-extras")]")
  else
    editables+=(-e "${plugin%/}")
  fi
done
# --no-build-isolation: build the editables with this venv's setuptools and wheel (installed
# above) instead of a fresh build environment per distribution (7 of them: ~40 s of setup).
"${PIP[@]}" --no-build-isolation "torch==2.13.0" "${editables[@]}"
# Integrations whose test dependencies cannot be expressed as extras (e.g. sglang --no-deps).
# vLLM's own venv (.venv-vllm/, integrations/vllm/setup-dev.sh) is built by `make vllm`, which
# `make test` runs beside the main suite.
for dev in integrations/*/setup-dev.sh; do
  [ "$dev" = integrations/vllm/setup-dev.sh ] && continue
  if [ -x "$dev" ]; then "$dev" "$VENV"; fi
done
# Editable installs skip the byte-compilation that `pip install` does for a regular install;
# do it here so start-up is measured (and felt) as users see it. Harmless when stale: Python
# recompiles a module whose source is newer than its cache.
"$VENV/bin/python" -m compileall -q hicache_core plugins >/dev/null || true
echo "setup: ready ($VENV: $("$VENV/bin/python" -c 'import torch, hicache_core; print("torch", torch.__version__, "hicache", hicache_core.__version__)'))"
