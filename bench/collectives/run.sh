#!/usr/bin/env bash
# all_reduce, reduce_scatter and all_gather latency at 4 KiB .. 64 MiB of
# float32, 2 ranks (processes, one OpenMP thread each) on this host, measured
# back to back in this run:
#   dtrain        dtrain's default transport (shared memory for CPU ranks on one host);
#   dtrain_gloo   dtrain with intra_host_shared_memory = false (Gloo, loopback TCP);
#   torch.distributed  gloo from Python (peer.py), same torch version.
# Each case: warm-up, then the median of 10 (64 MiB) .. 200 (<= 64 KiB) timed
# iterations, each after a barrier. The size is the full buffer (reduce_scatter's
# input, all_gather's output).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../common/launch.sh"
ranks="${1:-2}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
launch_ranks "$ranks" "$tmp/dtrain.jsonl" "$DTRAIN_BUILD/bench/bench_collectives"
launch_ranks "$ranks" "$tmp/gloo.jsonl" "$DTRAIN_BUILD/bench/bench_collectives" --gloo
launch_ranks "$ranks" "$tmp/peer.jsonl" "$DTRAIN_PYTHON" "$here/peer.py"
echo "# raw results (rank 0, $ranks ranks)"
cat "$tmp/dtrain.jsonl" "$tmp/gloo.jsonl" "$tmp/peer.jsonl"
echo "# table: p50 ms (lower is better); ratios > 1: the first named is faster"
"$DTRAIN_PYTHON" - "$tmp/dtrain.jsonl" "$tmp/gloo.jsonl" "$tmp/peer.jsonl" <<'PY'
import json, sys
load = lambda p: {r["case"]: r for r in map(json.loads, filter(lambda l: l.startswith("{"), open(p)))}
shm, gloo, torch = map(load, sys.argv[1:])
print(f"{'op':<15}{'bytes':>10}{'dtrain(shm)':>13}{'dtrain(gloo)':>14}{'torch':>10}"
      f"{'gloo/shm':>10}{'torch/shm':>11}{'torch/gloo':>12}")
for case, s in shm.items():
    g, t = gloo[case]["p50_ms"], torch[case]["p50_ms"]
    d = s["p50_ms"]
    print(f"{s['op']:<15}{s['bytes']:>10}{d:>13.3f}{g:>14.3f}{t:>10.3f}{g / d:>10.2f}{t / d:>11.2f}{t / g:>12.2f}")
PY
echo "# comparisons (ratio > 1: dtrain faster): dtrain vs torch, dtrain_gloo vs torch, dtrain vs dtrain_gloo"
cmp() { "$DTRAIN_PYTHON" "$here/../common/compare.py" --bench "$1" --dtrain "$2" --peer "$3" \
  --metric p50_ms:lower --metric p95_ms:lower; }
cmp collectives "$tmp/dtrain.jsonl" "$tmp/peer.jsonl"
cmp collectives_gloo "$tmp/gloo.jsonl" "$tmp/peer.jsonl"
cmp collectives_shm_vs_gloo "$tmp/dtrain.jsonl" "$tmp/gloo.jsonl"
