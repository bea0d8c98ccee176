# Shared settings for scripts/*.sh; sourced, not run.
# Everything heavy (the Python venv with the pinned torch wheel, ccache) lives
# outside the repository so a fresh clone reuses it.
DTRAIN_TORCH_VERSION="2.15.0"
DTRAIN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DTRAIN_CACHE="${DTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtrain}"
DTRAIN_VENV="$DTRAIN_CACHE/venv"
DTRAIN_PYTHON="$DTRAIN_VENV/bin/python"
# examples/gpt's corpus (scripts/setup.sh builds it; the example's default --data-dir).
DTRAIN_SHAKESPEARE_DIR="$DTRAIN_CACHE/shakespeare_char"
DTRAIN_BUILD="${DTRAIN_BUILD:-$DTRAIN_ROOT/build}"
# ccache's settings (cache directory, paths hashed relative to the checkout)
# live in CMakeLists.txt, so plain `cmake --build build` uses them too.
CCACHE_DIR="$DTRAIN_CACHE/ccache"

log() { printf '[dtrain-setup] %s\n' "$*" >&2; }
