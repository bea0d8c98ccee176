#!/usr/bin/env bash
# AMP on the CPU: training-step time of a matmul-heavy MLP (1024-4096-4096-1024-16,
# ~25 M parameters, batch 128) in fp32 and under bf16 autocast + GradScaler,
# dtrain (Autocast, GradScaler) against the same loop in Python
# (torch.autocast + torch.amp.GradScaler), same torch, one process, one
# intra-op thread, measured back to back in this run, case by case
# (dtrain, then Python), plus the bare 128x4096 @ 4096x4096 matmul in each dtype.
# Set DTRAIN_BENCH_QUICK=1 for fewer steps; DTRAIN_BENCH_THREADS for more threads.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
steps=20 warmup=3 batch=128 threads="${DTRAIN_BENCH_THREADS:-1}"
if [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ]; then steps=5 warmup=1; fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
args=(--steps "$steps" --warmup "$warmup" --batch "$batch" --threads "$threads")
for mode in mm fp32 bf16; do
  OMP_NUM_THREADS="$threads" timeout 900 "$DTRAIN_BUILD/bench/bench_amp" "${args[@]}" --mode "$mode" >>"$tmp/dtrain.jsonl"
  OMP_NUM_THREADS="$threads" timeout 900 "$DTRAIN_PYTHON" "$here/peer.py" "${args[@]}" --mode "$mode" >>"$tmp/peer.jsonl"
done
echo "# raw results"
cat "$tmp/dtrain.jsonl" "$tmp/peer.jsonl"
echo "# bf16 autocast + GradScaler vs fp32, per implementation (speedup > 1: bf16 is faster)"
"$DTRAIN_PYTHON" - "$tmp/dtrain.jsonl" "$tmp/peer.jsonl" <<'PY'
import json, sys
for path in sys.argv[1:]:
    rows = {r["case"]: r for r in map(json.loads, open(path))}
    impl = next(iter(rows.values()))["impl"]
    print(json.dumps({"impl": impl,
                      "mlp_step_speedup_bf16": round(rows["mlp_fp32"]["p50_ms"] / rows["mlp_bf16"]["p50_ms"], 3),
                      "mm_speedup_bf16": round(rows["mm_fp32"]["p50_ms"] / rows["mm_bf16"]["p50_ms"], 3)}))
PY
echo "# comparisons: dtrain vs Python, step time (lower is better)"
"$DTRAIN_PYTHON" "$here/../common/compare.py" --bench amp --dtrain "$tmp/dtrain.jsonl" --peer "$tmp/peer.jsonl" \
  --metric p50_ms:lower
