#!/usr/bin/env bash
# `dtrain run` against torchrun (same torch version) starting the same C++
# worker: time to first step, and from SIGKILL of a worker to the first step
# after recovery. Medians of 5 runs; ratio > 1 means dtrain is faster, and
# dtrain_over_peer is the fraction of torchrun's time dtrain needs.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cmake --build "$DTRAIN_BUILD" --target dtrain_cli bench_launcher_worker >/dev/null
OMP_NUM_THREADS=1 "$DTRAIN_PYTHON" "$here/run.py" --dtrain "$DTRAIN_BUILD/tools/dtrain" \
  --worker "$DTRAIN_BUILD/bench/bench_launcher_worker" --python-worker "$here/worker.py" "$@"
