#!/usr/bin/env bash
# The GPT's matrix products on one thread: dtrain::nn::onednn_mm (what
# dtrain::nn::linear runs on the CPU in fp32) against ATen's default at::mm in
# the same C++ process, and torch.mm from Python (the peer) in the same run.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
OMP_NUM_THREADS=1 "$DTRAIN_BUILD/bench/bench_matmul" >"$tmp/all.jsonl"
OMP_NUM_THREADS=1 "$DTRAIN_PYTHON" "$here/peer.py" >"$tmp/peer.jsonl"
grep '"impl": "dtrain"' "$tmp/all.jsonl" >"$tmp/dtrain.jsonl"
echo "# raw results (us per product, one thread)"
cat "$tmp/all.jsonl" "$tmp/peer.jsonl"
echo "# comparisons (ratio > 1: dtrain faster)"
"$DTRAIN_PYTHON" "$here/../common/compare.py" --bench matmul --dtrain "$tmp/dtrain.jsonl" --peer "$tmp/peer.jsonl" \
  --metric us:lower
echo "# fp32 matmul peak (GFLOP/s; square products of 1024 and 2048, best of ATen's at::mm and oneDNN)"
env -u OMP_NUM_THREADS "$DTRAIN_BUILD/bench/bench_matmul" --peak
