#!/usr/bin/env bash
# Two builds of dtrain against each other and against the Python peers, in
# one run: the no-regression check of a change that rewrites the paths the
# benches measure (issue 23's figure: gpt, pipeline and zero within 5 % of
# before). The same commands as bench gpt (single, ddp2), bench pipeline (b:
# unpipelined and every schedule on p = 2, m = 4) and bench zero (DDP,
# ZeRO-1/2/3 on 2 ranks), alternating OLD and NEW per case and round so load
# drifts hit both alike, then the peers once per round. One intra-op thread
# per process.
#   scripts/bench.sh ab OLD_BUILD_DIR [ROUNDS]   (NEW: this checkout's build)
# OLD_BUILD_DIR: a build of the old commit with examples/gpt, tools/dtrain,
# bench/bench_pipeline and bench/bench_zero, e.g.
#   git worktree add ../old <commit> && (cd ../old && scripts/setup.sh &&
#   cmake --build build --target bench_gpt bench_zero bench_pipeline)
# Prints a table (median per case; throughput, so > 1 is faster) and one
# JSON line per case with "new_over_old" and both builds' ratios to the peer.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../common/launch.sh"
old="${1:?usage: scripts/bench.sh ab OLD_BUILD_DIR [ROUNDS]}"
rounds="${2:-2}"
for b in examples/gpt tools/dtrain bench/bench_pipeline bench/bench_zero; do
  [ -x "$old/$b" ] || { echo "ab: $old/$b is missing: build the old commit's bench_gpt, bench_zero and bench_pipeline" >&2; exit 2; }
done
export OMP_NUM_THREADS=1
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
raw="$tmp/raw.jsonl"
cfg=(--max-iters 300 --eval-interval 250 --eval-iters 20 --batch-size 12 --n-layer 4 --n-head 4 --n-embd 128
  --block-size 64 --dropout 0 --lr 1e-3 --seed 1337)
split_for() { if [ "$1" = interleaved ]; then echo 0,0,1,2,3,3; else echo 0,0,0,1,1,1; fi; }
emit() {  # emit SIDE BENCH CASE ROUND < json lines
  grep '^{' | sed "s/^{/{\"side\":\"$1\",\"bench\":\"$2\",\"case\":\"$3\",\"round\":$4,/" >>"$raw"
}
for round in $(seq "$rounds"); do
  for s in single ddp2 none gpipe 1f1b interleaved zb ddp zero1 zero2 zero3; do
    for side in old new; do
      B="$DTRAIN_BUILD"
      [ "$side" = old ] && B="$old"
      case $s in
        single) "$B/examples/gpt" "${cfg[@]}" --sample-tokens 0 2>/dev/null | grep '"done"' | emit $side gpt $s $round ;;
        ddp2) "$B/tools/dtrain" run --nproc-per-node 2 "$B/examples/gpt" --strategy ddp --devices cpu "${cfg[@]}" \
          --sample-tokens 0 2>/dev/null | grep '"done"' | emit $side gpt $s $round ;;
        none) "$B/bench/bench_pipeline" --mode gpt --schedule none --steps 60 | emit $side pipeline $s $round ;;
        gpipe | 1f1b | interleaved | zb)
          "$B/tools/dtrain" run --nproc-per-node 2 "$B/bench/bench_pipeline" --mode gpt --schedule $s \
            --micro-batches 4 --split "$(split_for $s)" --steps 60 2>/dev/null | emit $side pipeline $s $round ;;
        *) launch_ranks 2 "$tmp/one.jsonl" "$B/bench/bench_zero" --strategy $s --steps 40 &&
          emit $side zero $s $round <"$tmp/one.jsonl" ;;
      esac
    done
  done
  "$DTRAIN_PYTHON" "$here/../gpt/peer.py" "${cfg[@]}" 2>/dev/null | grep '"done"' | emit torch gpt single $round
  "$DTRAIN_PYTHON" -m torch.distributed.run --nproc-per-node 2 --standalone "$here/../gpt/peer.py" "${cfg[@]}" \
    2>/dev/null | grep '"done"' | emit torch gpt ddp2 $round
  "$DTRAIN_PYTHON" "$here/../pipeline/peer.py" --schedule none --steps 60 2>/dev/null | emit torch pipeline none $round
  for s in gpipe 1f1b interleaved zb; do
    "$DTRAIN_PYTHON" -m torch.distributed.run --nproc-per-node 2 --standalone "$here/../pipeline/peer.py" \
      --schedule $s --micro-batches 4 --split "$(split_for $s)" --steps 60 2>/dev/null | emit torch pipeline $s $round
  done
  for s in ddp fsdp2 zero_redundancy; do
    launch_ranks 2 "$tmp/one.jsonl" "$DTRAIN_PYTHON" "$here/../zero/peer.py" --strategy $s --steps 40 &&
      emit torch zero $s $round <"$tmp/one.jsonl"
  done
  echo "# round $round done, load $(cut -d' ' -f1-3 /proc/loadavg)"
done
"$DTRAIN_PYTHON" "$here/report.py" "$raw"
