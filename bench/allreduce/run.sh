#!/usr/bin/env bash
# All-reduce latency, 2 ranks over Gloo on loopback: dtrain's process group
# against torch.distributed (same torch version), run back to back.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../common/launch.sh"
ranks="${1:-2}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
launch_ranks "$ranks" "$tmp/dtrain.jsonl" "$DTRAIN_BUILD/bench/bench_allreduce"
launch_ranks "$ranks" "$tmp/peer.jsonl" "$DTRAIN_PYTHON" "$here/peer.py"
echo "# raw results (rank 0, $ranks ranks)"
cat "$tmp/dtrain.jsonl" "$tmp/peer.jsonl"
echo "# comparisons (ratio > 1: dtrain faster)"
"$DTRAIN_PYTHON" "$here/../common/compare.py" --bench allreduce --dtrain "$tmp/dtrain.jsonl" \
  --peer "$tmp/peer.jsonl" --metric p50_us:lower --metric p95_us:lower
