#!/usr/bin/env bash
# Runs one benchmark: scripts/bench.sh NAME [ARGS...], NAME a folder of bench/.
# Each prints its figures and ends with one JSON line per comparison:
#   {"bench":..,"case":..,"metric":..,"dtrain":x,"peer":y,"peer_name":..,"ratio":r,
#    "machine":{"cpu":..,"cores":..,..}}
# with ratio > 1 meaning dtrain is better, both measured in the same run
# (gpt, pipeline, zero add "ratio_like_for_like": dtrain on ATen's kernels,
# DTRAIN_LINEAR_KERNEL=aten, against the same peer; docs/performance.md).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
name="${1:-}"
if [ -z "$name" ] || [ ! -x "$DTRAIN_ROOT/bench/$name/run.sh" ]; then
  echo "usage: scripts/bench.sh NAME [ARGS...]; NAME is one of:" >&2
  for d in "$DTRAIN_ROOT"/bench/*/; do [ -x "$d/run.sh" ] && echo "  $(basename "$d")" >&2; done
  exit 2
fi
shift
"$DTRAIN_ROOT/scripts/setup.sh"
cmake --build "$DTRAIN_BUILD" --target "bench_$name"
export DTRAIN_BUILD DTRAIN_PYTHON
# Every figure depends on the CPU (oneDNN vs MKL differ by family): say which,
# and how busy the machine was, before the bench's own lines (one helper for
# every bench: bench/common/machine.py).
"$DTRAIN_PYTHON" "$DTRAIN_ROOT/bench/common/machine.py" "$name"
exec "$DTRAIN_ROOT/bench/$name/run.sh" "$@"
