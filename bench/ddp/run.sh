#!/usr/bin/env bash
# dtrain DDP against torch DDP (same torch version), gloo, 2 processes, one
# OpenMP thread each, measured back to back in this run:
#   (a) small MLP (~0.1 M parameters, per-op overhead dominates), 25 MB buckets;
#   (b) large MLP (~21 M parameters, communication dominates), bucket sweep 1/5/25/100 MB,
#       and 25 MB with gradient_as_bucket_view (both sides).
# dtrain runs with its defaults, so its ranks on this one host all-reduce through
# shared memory; the *_gloo cases repeat (a) and (b) at 25 MB with dtrain on
# Gloo as well (the same c10d Reducer and transport as torch).
# Set DTRAIN_BENCH_QUICK=1 for fewer steps.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../common/launch.sh"
ranks=2
small_steps=400 large_steps=30
if [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ]; then small_steps=100 large_steps=10; fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
run_case() {  # model steps batch cap [--bucket-view]
  local args=(--model "$1" --steps "$2" --batch "$3" --bucket-cap-mb "$4" "${@:5}")
  launch_ranks "$ranks" "$tmp/one.jsonl" "$DTRAIN_BUILD/bench/bench_ddp" "${args[@]}"
  cat "$tmp/one.jsonl" >>"$tmp/dtrain.jsonl"
  launch_ranks "$ranks" "$tmp/one.jsonl" "$DTRAIN_PYTHON" "$here/peer.py" "${args[@]}"
  cat "$tmp/one.jsonl" >>"$tmp/peer.jsonl"
}
run_case small "$small_steps" 32 25
for cap in 1 5 25 100; do run_case large "$large_steps" 8 "$cap"; done
run_case large "$large_steps" 8 25 --bucket-view
run_case small "$small_steps" 32 25 --gloo
run_case large "$large_steps" 8 25 --gloo
echo "# raw results (rank 0 of $ranks)"
cat "$tmp/dtrain.jsonl" "$tmp/peer.jsonl"
echo "# comparisons: step time (lower is better) and hidden all-reduce fraction (higher is better)"
"$DTRAIN_PYTHON" "$here/../common/compare.py" --bench ddp --dtrain "$tmp/dtrain.jsonl" --peer "$tmp/peer.jsonl" \
  --metric p50_ms:lower --metric p95_ms:lower --metric hidden_fraction:higher
