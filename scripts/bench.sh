#!/usr/bin/env bash
# Runs one benchmark: scripts/bench.sh NAME [ARGS...], NAME a folder of bench/.
# Each prints its figures and ends with one JSON line per comparison:
#   {"bench":..,"case":..,"metric":..,"dtrain":x,"peer":y,"peer_name":..,"ratio":r}
# with ratio > 1 meaning dtrain is better, both measured in the same run.
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
exec "$DTRAIN_ROOT/bench/$name/run.sh" "$@"
