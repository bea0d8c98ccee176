#!/usr/bin/env bash
# ZeRO stages 1-3 against DDP on examples/gpt's GPT (4 layers, width 128,
# ~0.8 M parameters; batch 12 x 64 per rank), 2 ranks, CPU, one OpenMP thread
# each, all measured back to back in this run: dtrain DDP and ZeRO-1/2/3
# (peak memory of parameters + gradients + optimizer state per rank, measured,
# beside the fp32 AdamW formula; step time), and Python's torch DDP, FSDP2
# (fully_shard, CPU + gloo) and ZeroRedundancyOptimizer (same torch); then
# HSDP on 4 ranks (2 replicas x ZeRO-3 over 2, all-reduce across replicas)
# against FSDP2 over a 2-D mesh (dp_replicate, dp_shard). The fp32 dtrain
# cases run twice: on dtrain's kernels and on ATen's (DTRAIN_LINEAR_KERNEL=aten,
# the peer's at::linear), so each comparison has a like-for-like ratio too.
# Set DTRAIN_BENCH_QUICK=1 for fewer steps (and DTRAIN_BENCH_ROUNDS=1 for one round).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../common/launch.sh"
ranks=2 steps=40
if [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ]; then steps=10; fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
: >"$tmp/dtrain.jsonl"
: >"$tmp/peer.jsonl"
: >"$tmp/dtrain_aten.jsonl"
for round in $(seq "${DTRAIN_BENCH_ROUNDS:-3}"); do  # three rounds, interleaved, so load drifts hit every case alike
  for s in ddp zero1 zero2 zero3; do
    launch_ranks "$ranks" "$tmp/one.jsonl" "$DTRAIN_BUILD/bench/bench_zero" --strategy "$s" --steps "$steps" "$@"
    sed "s/\"impl\":\"dtrain\"/\"impl\":\"dtrain\",\"round\":$round/" "$tmp/one.jsonl" >>"$tmp/dtrain.jsonl"
    DTRAIN_LINEAR_KERNEL=aten launch_ranks "$ranks" "$tmp/one.jsonl" "$DTRAIN_BUILD/bench/bench_zero" --strategy "$s" \
      --steps "$steps" "$@"
    sed "s/\"impl\":\"dtrain\"/\"impl\":\"dtrain\",\"round\":$round/" "$tmp/one.jsonl" >>"$tmp/dtrain_aten.jsonl"
  done
  for s in zero1 zero2 zero3; do  # mixed precision: bf16 parameters and reductions, fp32 master shards
    launch_ranks "$ranks" "$tmp/one.jsonl" "$DTRAIN_BUILD/bench/bench_zero" --strategy "$s" --bf16 --steps "$steps" "$@"
    sed "s/\"impl\":\"dtrain\"/\"impl\":\"dtrain\",\"round\":$round/" "$tmp/one.jsonl" >>"$tmp/dtrain.jsonl"
  done
  for s in ddp fsdp2 zero_redundancy; do
    launch_ranks "$ranks" "$tmp/one.jsonl" "$DTRAIN_PYTHON" "$here/peer.py" --strategy "$s" --steps "$steps" "$@"
    sed "s/\"impl\"/\"round\":$round,\"impl\"/" "$tmp/one.jsonl" >>"$tmp/peer.jsonl"
  done
  for kernel in auto aten; do
    out="$tmp/dtrain.jsonl"
    [ "$kernel" = aten ] && out="$tmp/dtrain_aten.jsonl"
    DTRAIN_LINEAR_KERNEL="$kernel" launch_ranks 4 "$tmp/one.jsonl" "$DTRAIN_BUILD/bench/bench_zero" --strategy zero3 \
      --replicas 2 --steps "$steps" "$@"
    sed "s/\"impl\":\"dtrain\"/\"impl\":\"dtrain\",\"round\":$round/" "$tmp/one.jsonl" >>"$out"
  done
  launch_ranks 4 "$tmp/one.jsonl" "$DTRAIN_PYTHON" "$here/peer.py" --strategy fsdp2 --replicas 2 --case hsdp2x2 \
    --steps "$steps" "$@"
  sed "s/\"impl\"/\"round\":$round,\"impl\"/" "$tmp/one.jsonl" >>"$tmp/peer.jsonl"
done
echo "# raw results (rank 0 of $ranks)"
cat "$tmp/dtrain.jsonl" "$tmp/dtrain_aten.jsonl" "$tmp/peer.jsonl"
"$DTRAIN_PYTHON" "$here/report.py" "$tmp/dtrain.jsonl" "$tmp/peer.jsonl" "$tmp/dtrain_aten.jsonl"
