#!/usr/bin/env bash
# The flight recorder's cost (docs/flight_recorder.md): the CPU time one
# operation pays with it on (flight_recorder_bench), and the GPT under DDP on
# 2 ranks with it off and on (2000 entries), interleaved, STEPS steps each.
set -euo pipefail
STEPS="${STEPS:-30}"
PAIRS="${PAIRS:-4}"
DTRAIN_FLIGHT_RECORDER=2000 DTRAIN_FLIGHT_RECORDER_DIR="$(mktemp -d)" "$DTRAIN_BUILD/bench/bench_flight_recorder"
dumps="$(mktemp -d)"
for _ in $(seq "$PAIRS"); do
  for mode in off on; do
    if [ "$mode" = on ]; then export DTRAIN_FLIGHT_RECORDER=2000 DTRAIN_FLIGHT_RECORDER_DIR="$dumps"; else unset DTRAIN_FLIGHT_RECORDER DTRAIN_FLIGHT_RECORDER_DIR; fi
    line=$("$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node 2 "$DTRAIN_BUILD/examples/gpt" --strategy ddp \
      --max-iters "$STEPS" --eval-interval 100000 --eval-iters 1 --sample-tokens 0 2>/dev/null | grep '"event":"done"')
    echo "{\"bench\":\"flight_recorder\",\"recorder\":\"$mode\",\"gpt\":$line}"
  done
done
rm -rf "$dumps"
