#!/usr/bin/env bash
# Sets up (idempotent), builds, and runs the main job: training a small CNN on
# Fashion-MNIST. Extra arguments go to the example (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
"$DTRAIN_ROOT/scripts/setup.sh"
cmake --build "$DTRAIN_BUILD" --target fashion_mnist
exec "$DTRAIN_BUILD/examples/fashion_mnist" --strategy single --epochs 2 "$@"
