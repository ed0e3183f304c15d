#!/usr/bin/env bash
# Install the real SGLang package for the hicache-sglang tests (idempotent).
#   sglang==0.5.23 pins a CUDA torch and GPU-only packages, so it is installed WITHOUT its
#   dependencies; the light ones its storage modules import come from this distribution's
#   `test` extra (see pyproject.toml), which scripts/setup.sh installs via .dev-extras.
# Usage: integrations/sglang/setup-dev.sh [VENV]   (default: .venv at the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-${VENV:-.venv}}
SGLANG_VERSION=0.5.23
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
  exit 0
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "sglang==$SGLANG_VERSION"
