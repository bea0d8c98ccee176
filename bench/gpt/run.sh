#!/usr/bin/env bash
# dtrain's GPT (examples/gpt) against the same model in Python PyTorch
# (bench/gpt/peer.py, same torch), nanoGPT's CPU run of shakespeare_char:
# 4 layers, 4 heads, width 128, context 64, batch 12 per rank, 2000 steps,
# dropout 0, same initialisation, batches and hyperparameters on both sides.
#   single: one process;  ddp2: 2 ranks (`dtrain run` vs torchrun, gloo),
#   12 sequences per rank, so 24 per step.
# Per case, back to back in this run: dtrain, dtrain on ATen's kernels
# (DTRAIN_LINEAR_KERNEL=aten: its Linears on at::linear, as the peer's),
# the peer; for single also the peer under torch.compile (steady-state
# tokens/s; its compile time reported apart). Each comparison line carries
# "ratio" (dtrain's kernels) and "ratio_like_for_like" (ATen's on both
# sides): their quotient is the kernel's gain, the like-for-like ratio the
# rest of dtrain's. MFU: model FLOPs (nanoGPT's 6N + 12 L d T per token) per
# second over the machine's measured fp32 matmul peak (bench_matmul --peak:
# one thread for single, every core for ddp2).
# Every process uses one intra-op thread (DTRAIN_BENCH_THREADS for the single
# cases): on a 2-core machine shared with builds, two OpenMP threads per
# process measure the neighbours more than the program.
#   scaling: what separates a 2-rank step from a single process's, on the
#   same GPT with SGD and 16 sequences per rank (bench_pipeline --schedule
#   none): one process; 2 ranks each training alone with one barrier per step
#   ("lockstep": the machine's ceiling, i.e. the cores' contention and each
#   step waiting for the slower rank); 2 ranks under dtrain's DDP. Rounds of
#   the three, alternating (DTRAIN_BENCH_ROUNDS, default 5); medians of
#   ceiling = lockstep / (2 x single), efficiency = ddp / (2 x single) and
#   ddp / lockstep (the distributed layer's own share); the same three for
#   torch in the same rounds (bench/pipeline/peer.py: one process, torchrun
#   lockstep, torch DDP), so DDP / lockstep compares the two DDPs alone.
# DTRAIN_BENCH_QUICK=1: 200 steps; DTRAIN_BENCH_STEPS=N: N steps (the suite's
# short run); DTRAIN_BENCH_CASES="single" (default "single ddp2 scaling");
# DTRAIN_BENCH_COMPILE=0: no torch.compile peer (it compiles for ~25 s).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
iters=2000
if [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ]; then iters=200; fi
iters="${DTRAIN_BENCH_STEPS:-$iters}"
threads="${DTRAIN_BENCH_THREADS:-1}"
cases="${DTRAIN_BENCH_CASES:-single ddp2 scaling}"
model=(--n-layer 4 --n-head 4 --n-embd 128 --block-size 64)
config=(--max-iters "$iters" --eval-interval 250 --eval-iters 20 --batch-size 12 "${model[@]}"
  --dropout 0 --lr 1e-3 --seed 1337)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
: >"$tmp/dtrain.jsonl"
: >"$tmp/dtrain_aten.jsonl"
: >"$tmp/peer.jsonl"
: >"$tmp/compile.jsonl"

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

# scaling_run CMD...: runs CMD on one intra-op thread and appends its JSON
# lines to the scaling case's file; on a failure shows its errors and stops.
scaling_run() {
  OMP_NUM_THREADS=1 "$@" 2>"$tmp/err" | grep '^{' >>"$tmp/scaling.jsonl" || { cat "$tmp/err" >&2; exit 1; }
}

# The matmul peak first, on an otherwise idle program (every core: no OMP limit).
env -u OMP_NUM_THREADS "$DTRAIN_BUILD/bench/bench_matmul" --peak >"$tmp/peak.jsonl"
gpt="$DTRAIN_BUILD/examples/gpt"
for case in $cases; do
  case "$case" in
    single)
      for kernel in auto aten; do
        out="$tmp/dtrain.jsonl"
        [ "$kernel" = aten ] && out="$tmp/dtrain_aten.jsonl"
        DTRAIN_LINEAR_KERNEL="$kernel" OMP_NUM_THREADS="$threads" run_case single "$out" "$gpt" "${config[@]}" \
          --sample-tokens 0
      done
      OMP_NUM_THREADS="$threads" run_case single "$tmp/peer.jsonl" "$DTRAIN_PYTHON" "$here/peer.py" "${config[@]}"
      if [ "${DTRAIN_BENCH_COMPILE:-1}" = 1 ]; then
        OMP_NUM_THREADS="$threads" run_case single "$tmp/compile.jsonl" "$DTRAIN_PYTHON" "$here/peer.py" \
          "${config[@]}" --compile
      fi ;;
    ddp2)
      for kernel in auto aten; do
        out="$tmp/dtrain.jsonl"
        [ "$kernel" = aten ] && out="$tmp/dtrain_aten.jsonl"
        DTRAIN_LINEAR_KERNEL="$kernel" OMP_NUM_THREADS=1 run_case ddp2 "$out" "$DTRAIN_BUILD/tools/dtrain" run \
          --nproc-per-node 2 "$gpt" --strategy ddp --devices cpu "${config[@]}" --sample-tokens 0
      done
      OMP_NUM_THREADS=1 run_case ddp2 "$tmp/peer.jsonl" "$DTRAIN_PYTHON" -m torch.distributed.run \
        --nproc-per-node 2 --standalone "$here/peer.py" "${config[@]}" ;;
    scaling)
      scaling_steps=60
      [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ] && scaling_steps=30
      scaling_steps="${DTRAIN_BENCH_STEPS:-$scaling_steps}"
      bp="$DTRAIN_BUILD/bench/bench_pipeline"
      pp="$here/../pipeline/peer.py"
      : >"$tmp/scaling.jsonl"
      for round in $(seq "${DTRAIN_BENCH_ROUNDS:-5}"); do
        echo "# scaling round $round" >&2
        scaling_run "$bp" --mode gpt --schedule none --steps "$scaling_steps"
        for dp in lockstep ddp; do
          scaling_run "$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node 2 "$bp" --mode gpt --schedule none \
            --data-parallel "$dp" --steps "$scaling_steps"
        done
        scaling_run "$DTRAIN_PYTHON" "$pp" --schedule none --steps "$scaling_steps"
        for dp in lockstep ddp; do
          scaling_run "$DTRAIN_PYTHON" -m torch.distributed.run --nproc-per-node 2 --standalone "$pp" \
            --schedule none --data-parallel "$dp" --steps "$scaling_steps"
        done
      done ;;
    *) echo "bench gpt: unknown case '$case' in DTRAIN_BENCH_CASES (single, ddp2, scaling)" >&2; exit 2 ;;
  esac
done

echo "# raw results"
cat "$tmp/peak.jsonl" "$tmp/dtrain.jsonl" "$tmp/dtrain_aten.jsonl" "$tmp/peer.jsonl" "$tmp/compile.jsonl"
if [ -s "$tmp/scaling.jsonl" ]; then
  cat "$tmp/scaling.jsonl"
  echo "# scaling: per round and side single / lockstep / ddp tokens/s, then the medians"
  "$DTRAIN_PYTHON" "$here/scaling_report.py" "$tmp/scaling.jsonl"
fi
"$DTRAIN_PYTHON" "$here/report.py" --dir "$tmp" --threads "$threads" "${model[@]}"
echo "# comparisons (ratio > 1: dtrain better; ratio_like_for_like: dtrain on ATen's kernels)"
for peer in peer compile; do
  "$DTRAIN_PYTHON" "$here/../common/compare.py" --bench gpt --dtrain "$tmp/dtrain.jsonl" --peer "$tmp/$peer.jsonl" \
    --dtrain-aten "$tmp/dtrain_aten.jsonl" --metric tokens_per_second:higher --metric wall_seconds:lower \
    --metric val_loss:lower
done
