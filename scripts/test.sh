#!/usr/bin/env bash
# Sets up (idempotent), builds, and runs the whole test suite with ctest.
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
"$DTRAIN_ROOT/scripts/setup.sh"
"$DTRAIN_ROOT/scripts/check_format.sh"
cmake --build "$DTRAIN_BUILD"
cd "$DTRAIN_BUILD"
# gpu-labelled tests skip themselves where no GPU is visible.
exec ctest --output-on-failure -j "$(nproc)" --timeout 600 "$@"
