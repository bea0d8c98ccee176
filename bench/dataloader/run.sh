#!/usr/bin/env bash
# dtrain's DataLoader against torch.utils.data.DataLoader (same torch version):
# Fashion-MNIST, per-example flip + padded crop, batch 64, 0/1/2 workers,
# persistent workers on/off, two epochs of up to N batches each (default 450).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
batches="${1:-450}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
OMP_NUM_THREADS=1 "$DTRAIN_BUILD/bench/bench_dataloader" "$batches" >"$tmp/dtrain.jsonl"
OMP_NUM_THREADS=1 "$DTRAIN_PYTHON" "$here/peer.py" "$batches" >"$tmp/peer.jsonl"
echo "# raw results"
cat "$tmp/dtrain.jsonl" "$tmp/peer.jsonl"
echo "# comparisons (ratio > 1: dtrain better)"
"$DTRAIN_PYTHON" "$here/../common/compare.py" --bench dataloader --dtrain "$tmp/dtrain.jsonl" --peer "$tmp/peer.jsonl" \
  --metric samples_per_second:higher --metric first_batch_ms:lower --metric second_epoch_first_batch_ms:lower
