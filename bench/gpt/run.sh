#!/usr/bin/env bash
# dtrain's GPT (examples/gpt) against the same model in Python PyTorch
# (bench/gpt/peer.py, same torch), nanoGPT's CPU run of shakespeare_char:
# 4 layers, 4 heads, width 128, context 64, batch 12 per rank, 2000 steps,
# dropout 0, same initialisation, batches and hyperparameters on both sides.
#   single: one process;  ddp2: 2 ranks (`dtrain run` vs torchrun, gloo),
#   12 sequences per rank, so 24 per step.
# Back to back in this run: dtrain single, peer single, dtrain ddp2, peer ddp2.
# Every process uses one intra-op thread (DTRAIN_BENCH_THREADS for the single
# cases): on a 2-core machine shared with builds, two OpenMP threads per
# process measure the neighbours more than the program.
# DTRAIN_BENCH_QUICK=1: 200 steps.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
iters=2000
if [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ]; then iters=200; fi
threads="${DTRAIN_BENCH_THREADS:-1}"
config=(--max-iters "$iters" --eval-interval 250 --eval-iters 20 --batch-size 12 --block-size 64
  --n-layer 4 --n-head 4 --n-embd 128 --dropout 0 --lr 1e-3 --seed 1337)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# run_case CASE IMPL_FILE CMD...: runs CMD, keeps its output, and appends its
# done line with the case name and wall time to IMPL_FILE.
run_case() {
  local case="$1" into="$2"
  shift 2
  echo "# $case: $*" >&2
  local start end
  start="$(date +%s.%N)"
  "$@" >"$tmp/out" 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
  end="$(date +%s.%N)"
  grep '"event"' "$tmp/out" | sed 's/^/  /' >&2
  "$DTRAIN_PYTHON" - "$case" "$start" "$end" "$tmp/out" >>"$into" <<'PY'
import json, sys
case, start, end, path = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
done = [json.loads(l) for l in open(path) if l.startswith("{") and '"done"' in l][-1]
done.update(case=case, wall_seconds=round(end - start, 2), impl=done.get("impl", "dtrain"))
print(json.dumps(done))
PY
}

gpt="$DTRAIN_BUILD/examples/gpt"
OMP_NUM_THREADS="$threads" run_case single "$tmp/dtrain.jsonl" "$gpt" "${config[@]}" --sample-tokens 0
OMP_NUM_THREADS="$threads" run_case single "$tmp/peer.jsonl" "$DTRAIN_PYTHON" "$here/peer.py" "${config[@]}"
OMP_NUM_THREADS=1 run_case ddp2 "$tmp/dtrain.jsonl" "$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node 2 \
  "$gpt" --strategy ddp --devices cpu "${config[@]}" --sample-tokens 0
OMP_NUM_THREADS=1 run_case ddp2 "$tmp/peer.jsonl" "$DTRAIN_PYTHON" -m torch.distributed.run --nproc-per-node 2 \
  --standalone "$here/peer.py" "${config[@]}"

echo "# raw results"
cat "$tmp/dtrain.jsonl" "$tmp/peer.jsonl"
echo "# step-time breakdown, mean ms per step after 10 warm-up steps (ddp2: backward includes the all-reduce;"
echo "# exposed communication = ddp2 backward - single backward, same per-rank batch and threads)"
"$DTRAIN_PYTHON" - "$tmp/dtrain.jsonl" "$tmp/peer.jsonl" <<'PY'
import json, sys
rows = {}
for path, side in zip(sys.argv[1:], ["dtrain", "peer"]):
    for line in open(path):
        r = json.loads(line)
        rows[(side, r["case"])] = r
print(f"{'side':8}{'case':8}{'forward':>10}{'backward':>10}{'optimizer':>10}{'comm':>8}{'tok/s':>10}{'val':>8}{'wall s':>8}")
for side in ["dtrain", "peer"]:
    for case in ["single", "ddp2"]:
        r = rows.get((side, case))
        if r is None:
            continue
        ms = r["step_ms"]
        comm = ""
        if case == "ddp2" and (side, "single") in rows:
            comm = f"{ms['backward'] - rows[(side, 'single')]['step_ms']['backward']:.1f}"
        print(f"{side:8}{case:8}{ms['forward']:10.1f}{ms['backward']:10.1f}{ms['optimizer']:10.1f}{comm:>8}"
              f"{r['tokens_per_second']:10.0f}{r['val_loss']:8.4f}{r['wall_seconds']:8.1f}")
PY
echo "# comparisons (ratio > 1: dtrain better)"
"$DTRAIN_PYTHON" "$here/../common/compare.py" --bench gpt --dtrain "$tmp/dtrain.jsonl" --peer "$tmp/peer.jsonl" \
  --metric tokens_per_second:higher --metric wall_seconds:lower --metric val_loss:lower
