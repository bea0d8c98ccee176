#!/usr/bin/env bash
# Sets up (idempotent), builds, and runs the main job: `dtrain run` launching
# two processes that train a small CNN on Fashion-MNIST with
# DistributedDataParallel over Gloo. Extra arguments go to the example (see
# build/examples/fashion_mnist --help), e.g. scripts/demo.sh --epochs 3;
# DTRAIN_DEMO_RANKS sets the process count.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
"$DTRAIN_ROOT/scripts/setup.sh"
cmake --build "$DTRAIN_BUILD" --target fashion_mnist dtrain_cli
exec "$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node "${DTRAIN_DEMO_RANKS:-2}" \
  "$DTRAIN_BUILD/examples/fashion_mnist" --strategy ddp --epochs 2 "$@"
