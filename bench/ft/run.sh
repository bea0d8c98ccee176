#!/usr/bin/env bash
# Fault tolerance (issue 27): the SIGKILL of one of 4 replica groups under
# dtrain's fault-tolerant replicas, dtrain's restart-from-checkpoint and
# torchft 0.2.0 (its lighthouse, Manager and ProcessGroupGloo); fault to the
# first full-quorum step, steps trained again, and the steady step time with
# fault tolerance on and off. The GPT by default (examples/gpt; --model mlp:
# bench_ft_worker's MLP). Arguments go to run.py (e.g. --steps 300).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cmake --build "$DTRAIN_BUILD" --target bench_ft gpt >/dev/null
OMP_NUM_THREADS=1 "$DTRAIN_PYTHON" "$here/run.py" --dtrain "$DTRAIN_BUILD/tools/dtrain" \
  --worker "$DTRAIN_BUILD/bench/bench_ft_worker" --gpt "$DTRAIN_BUILD/examples/gpt" --python "$DTRAIN_PYTHON" \
  --torchft-worker "$here/torchft_worker.py" --torchft-lighthouse "$(dirname "$DTRAIN_PYTHON")/torchft_lighthouse" "$@"
