#!/usr/bin/env bash
# Sets up (idempotent), builds, and runs the main job: `dtrain run` launching
# two processes that train a character-level GPT (nanoGPT's shakespeare_char
# model: 4 layers, 4 heads, width 128, context 64) on the complete works of
# Shakespeare with DistributedDataParallel, a few minutes on 2 cores, then
# print a generated passage and the val loss. Extra arguments go to the
# example (build/examples/gpt --help) and override the defaults here, e.g.
# scripts/demo.sh --max-iters 500; DTRAIN_DEMO_RANKS sets the process count.
# The Fashion-MNIST example: build/examples/fashion_mnist (see the README).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
"$DTRAIN_ROOT/scripts/setup.sh"
cmake --build "$DTRAIN_BUILD" --target gpt dtrain_cli
# One intra-op thread per rank: the ranks share the machine's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node "${DTRAIN_DEMO_RANKS:-2}" \
  "$DTRAIN_BUILD/examples/gpt" --strategy ddp --devices cpu --max-iters 2000 --eval-interval 250 "$@"
