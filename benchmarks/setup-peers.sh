#!/usr/bin/env bash
# Install the peer storage layers that benchmarks/bench_peers.py runs beside hicache, one venv each
# under benchmarks/.peers/ (git-ignored), idempotent: a peer whose venv already has the pinned
# version is left as it is. A peer that cannot be installed is reported and skipped (the benchmark
# then reports it as missing); the script fails only when no venv can be created at all.
#   lmcache  LMCache 0.5.6 (local-disk backend). Its wheel requires CUDA packages (cupy-cuda13x,
#            cuda-python, nixl-cu12/13, cufile-python, nvtx) that its local-disk path never
#            imports on CPU, so it is installed --no-deps with the CPU torch and the light modules
#            that path imports.
#   sglang   SGLang 0.5.23 --no-deps (it pins a CUDA torch) plus what its HiCacheFile imports on
#            CPU (the same list as integrations/sglang's `test` extra).
#   nixl     NIXL 1.5.1 (`pip install nixl`: the meta package and its wheels; the POSIX plugin
#            runs on CPU).
# torch is pinned to 2.13.0 everywhere (the CPU wheel; a bare `torch` pulls a multi-GB CUDA build).
# Usage: benchmarks/setup-peers.sh [lmcache] [sglang] [nixl]   (default: all three)
set -uo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
PEERS=${HICACHE_PEERS_DIR:-.peers}
TORCH="torch==2.13.0"
LMCACHE_VERSION=0.5.6
SGLANG_VERSION=0.5.23
NIXL_VERSION=1.5.1

LMCACHE_DEPS=("numpy<=2.2.6" pyyaml aiofile aiofiles psutil msgspec sortedcontainers "pyzmq>=25.0.0"
  "prometheus_client>=0.18.0,<=0.24.1" cachetools py-cpuinfo safetensors redis httpx requests numba
  aiohttp transformers cryptography)
SGLANG_DEPS=(numpy orjson psutil pybase64 requests "triton==3.9.0" packaging pillow starlette msgspec
  "pydantic>=2.6" "pyzmq>=25.1.2" tqdm ipython aiohttp "prometheus-client>=0.20.0")

declare -A STATUS

pip_in() { "$PEERS/$1/bin/python" -m pip install -q --disable-pip-version-check "${@:2}"; }

has_version() {  # venv dist version
  "$PEERS/$1/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$2') != '$3')" 2>/dev/null
}

install() {  # name dist version import-check -- install steps (a function name)
  local name=$1 dist=$2 version=$3 check=$4 steps=$5
  if [ -x "$PEERS/$name/bin/python" ] && has_version "$name" "$dist" "$version" \
    && "$PEERS/$name/bin/python" -c "$check" >/dev/null 2>&1; then
    STATUS[$name]="ok (already installed)"
    return
  fi
  echo "setup-peers: installing $name ($dist $version) into $PEERS/$name ..."
  if [ ! -x "$PEERS/$name/bin/python" ] && ! "$PYTHON" -m venv "$PEERS/$name"; then
    STATUS[$name]="FAILED: cannot create the venv"
    return
  fi
  if ! "$steps" "$name"; then
    STATUS[$name]="FAILED: pip install (see above)"
    return
  fi
  if ! "$PEERS/$name/bin/python" -c "$check"; then
    STATUS[$name]="FAILED: installed, but '$check' does not import (see above)"
    return
  fi
  STATUS[$name]="ok"
}

steps_lmcache() {
  pip_in "$1" "$TORCH" "${LMCACHE_DEPS[@]}" && pip_in "$1" --no-deps "lmcache==$LMCACHE_VERSION"
}
steps_sglang() {
  pip_in "$1" "$TORCH" "${SGLANG_DEPS[@]}" && pip_in "$1" --no-deps "sglang==$SGLANG_VERSION"
}
steps_nixl() {
  pip_in "$1" "$TORCH" "nixl==$NIXL_VERSION"
}

mkdir -p "$PEERS"
wanted=("$@")
[ ${#wanted[@]} -eq 0 ] && wanted=(lmcache sglang nixl)
for peer in "${wanted[@]}"; do
  case $peer in
    lmcache) install lmcache lmcache "$LMCACHE_VERSION" \
      "from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend" steps_lmcache ;;
    sglang) install sglang sglang "$SGLANG_VERSION" \
      "from sglang.srt.mem_cache.hicache_storage import HiCacheFile" steps_sglang ;;
    nixl) install nixl nixl "$NIXL_VERSION" \
      "from nixl._api import nixl_agent as a, nixl_agent_config as c; a('probe', c(backends=[])).create_backend('POSIX', {})" steps_nixl ;;
    *) STATUS[$peer]="FAILED: unknown peer (known: lmcache sglang nixl)" ;;
  esac
done

echo "setup-peers: what is installed under $(cd "$PEERS" && pwd):"
for peer in "${wanted[@]}"; do
  line="  $peer: ${STATUS[$peer]}"
  if [ -x "$PEERS/$peer/bin/python" ]; then
    line+=" ($("$PEERS/$peer/bin/python" -c "
import importlib.metadata as m, sys
out = ['python ' + sys.version.split()[0]]
for d in ('$peer', 'torch'):
    try:
        out.append(d + ' ' + m.version(d))
    except m.PackageNotFoundError:
        out.append(d + ' missing')
print(', '.join(out))" 2>/dev/null))"
  fi
  echo "$line"
done
exit 0
