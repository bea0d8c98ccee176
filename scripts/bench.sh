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
# Every figure depends on the CPU (oneDNN vs MKL differ by family): say which,
# and how busy the machine was, before the bench's own lines.
cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
family="$(sed -n 's/^cpu family[[:space:]]*: //p' /proc/cpuinfo | head -1)"
model="$(sed -n 's/^model[[:space:]]*: //p' /proc/cpuinfo | head -1)"
echo "# machine: ${cpu:-unknown CPU} (family ${family:-?} model ${model:-?}), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf '{"bench":"%s","machine":{"cpu":"%s","family":"%s","model":"%s","cores":%d,"load":"%s"}}\n' \
  "$name" "${cpu:-unknown}" "${family:-?}" "${model:-?}" "$(nproc)" "$(cut -d' ' -f1-3 /proc/loadavg)"
exec "$DTRAIN_ROOT/bench/$name/run.sh" "$@"
