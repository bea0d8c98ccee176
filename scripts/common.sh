# Shared settings for scripts/*.sh; sourced, not run.
# Everything heavy (the Python venv with the pinned torch wheel, ccache) lives
# outside the repository so a fresh clone reuses it.
#
# The pinned torch is what everything builds against by default; another
# version of the supported window (LibTorch 2.11 through 2.15,
# cmake/DtrainTorch.cmake) gets its own venv and build tree: pass
# `--torch VERSION` to setup.sh or test.sh (or set DTRAIN_TORCH_VERSION).
DTRAIN_TORCH_PINNED="2.15.0"
DTRAIN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DTRAIN_CACHE="${DTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtrain}"

# Sets DTRAIN_TORCH_VERSION and the venv, python and build tree that go with it.
dtrain_select_torch() {
  DTRAIN_TORCH_VERSION="$1"
  if [ "$DTRAIN_TORCH_VERSION" = "$DTRAIN_TORCH_PINNED" ]; then
    DTRAIN_VENV="$DTRAIN_CACHE/venv"
    DTRAIN_BUILD="${DTRAIN_BUILD_OVERRIDE:-$DTRAIN_ROOT/build}"
  else
    DTRAIN_VENV="$DTRAIN_CACHE/venv-torch$DTRAIN_TORCH_VERSION"
    DTRAIN_BUILD="${DTRAIN_BUILD_OVERRIDE:-$DTRAIN_ROOT/build-torch${DTRAIN_TORCH_VERSION%.*}}"
  fi
  DTRAIN_PYTHON="$DTRAIN_VENV/bin/python"
}
# `--torch VERSION` among a script's arguments selects that version; the other
# arguments are left in DTRAIN_ARGS.
dtrain_parse_torch_option() {
  DTRAIN_ARGS=()
  while (($#)); do
    case "$1" in
      --torch) [ $# -ge 2 ] || { log "--torch needs a version, e.g. --torch 2.11.0"; exit 2; }
        dtrain_select_torch "$2"; shift 2 ;;
      --torch=*) dtrain_select_torch "${1#--torch=}"; shift ;;
      *) DTRAIN_ARGS+=("$1"); shift ;;
    esac
  done
}
DTRAIN_BUILD_OVERRIDE="${DTRAIN_BUILD:-}"
dtrain_select_torch "${DTRAIN_TORCH_VERSION:-$DTRAIN_TORCH_PINNED}"
# examples/gpt's corpus (scripts/setup.sh builds it; the example's default --data-dir).
DTRAIN_SHAKESPEARE_DIR="$DTRAIN_CACHE/shakespeare_char"
# ccache's settings (cache directory, paths hashed relative to the checkout)
# live in CMakeLists.txt, so plain `cmake --build build` uses them too.
CCACHE_DIR="$DTRAIN_CACHE/ccache"

log() { printf '[dtrain-setup] %s\n' "$*" >&2; }
