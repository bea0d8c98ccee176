#!/usr/bin/env bash
# Sets up (idempotent), builds, and runs the whole test suite with ctest.
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit.
#
# `--torch VERSION` tests against another torch of the supported window (its
# own venv and build tree, scripts/setup.sh --torch). With labels given
# (-L 'unit|multirank'), only the test binaries of those labels are built.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dtrain_parse_torch_option "$@"
set -- ${DTRAIN_ARGS[@]+"${DTRAIN_ARGS[@]}"}
"$DTRAIN_ROOT/scripts/setup.sh" --torch "$DTRAIN_TORCH_VERSION"
"$DTRAIN_ROOT/scripts/check_format.sh"
# -L LABELS (labels joined by '|'): build the dtrain_tests_<label> targets
# only (tests/CMakeLists.txt), not the examples and benchmarks. The system
# tests install the package and run the examples, so `system` builds all.
targets=()
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  if [ "${args[i]}" = "-L" ] && ((i + 1 < ${#args[@]})) && [[ "${args[i + 1]}" =~ ^[a-z|]+$ ]]; then
    IFS='|' read -r -a labels <<<"${args[i + 1]}"
    for label in "${labels[@]}"; do targets+=("dtrain_tests_$label"); done
  fi
done
[[ " ${targets[*]-} " == *" dtrain_tests_system "* ]] && targets=()
log "building $DTRAIN_BUILD (torch $DTRAIN_TORCH_VERSION)${targets[*]+: ${targets[*]}}"
cmake --build "$DTRAIN_BUILD" ${targets[@]+--target "${targets[@]}"}
cd "$DTRAIN_BUILD"
# gpu-labelled tests skip themselves where no GPU is visible.
exec ctest --output-on-failure -j "$(nproc)" --timeout 600 "$@"
