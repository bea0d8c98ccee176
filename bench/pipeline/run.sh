#!/usr/bin/env bash
# Pipeline schedules (issue 14).
# (a) The schedules isolated from the machine's cores: p = 4 rank threads whose
#     stages sleep a calibrated time (F = I = W = DTRAIN_BENCH_UNIT_MS, default
#     40), m = 4, 8, 12, 16: measured bubble beside its formula, and each
#     rank's peak activations in flight.
# (b) The GPT (4 layers, 4 heads, width 128, context 64, 16 sequences per step,
#     SGD) on p = 2 processes, every schedule with 4 micro-batches, dtrain
#     (`dtrain run`) and torch.distributed.pipelining (torchrun, gloo) back to
#     back per schedule, same cut of the layers; and the unpipelined model in
#     one process on both sides. One intra-op thread per process. Three rounds
#     over all cases; each case's figure is the median of its three runs.
#     dtrain's stages send activations and gradients through its shared-memory
#     rings (src/comm/shm_p2p.cpp); one more 1F1B run sends them through Gloo
#     (--transport gloo) to show what the rings change. The dtrain side calls
#     retain_freed_host_memory() as examples/gpt does (the same mallopt in the
#     Python peer measured no different). Every dtrain case runs once more
#     on ATen's kernels (DTRAIN_LINEAR_KERNEL=aten: the peer's at::linear), so
#     each comparison carries a like-for-like ratio beside dtrain's own.
# (c) DP x PP on 4 processes (2 replicas x 2 stages), the GPT example
#     (examples/gpt --strategy pipeline --pp-size 2, 1F1B, 4 micro-batches,
#     8 sequences per replica): tokens/s for each --dp-reduce (ddp, zero1,
#     zero2, allreduce), and the val loss each ends at (equal: the reductions
#     compute the same step). dtrain only: no Python peer runs this mesh.
# (d) ZeRO-3 x PP 2 x 2 on 4 processes: the bench GPT of (b) (1F1B, 4
#     micro-batches, 16 sequences per step, 8 per replica, SGD), each stage
#     ZeRO-3 over its 2 replicas (dp_shard): dtrain (bench_pipeline --dp-shard 2,
#     the stage gathered once per step) against FSDP2 fully_shard per layer
#     with reshard_after_forward=False inside torch.distributed.pipelining
#     (torchrun, gloo), alternating, median of `reps` runs each (dtrain also
#     on ATen's kernels, as in (b)).
# DTRAIN_BENCH_QUICK=1: fewer steps. DTRAIN_BENCH_PARTS="b d": only those
# parts (default "a b c d").
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
steps=60
sleep_steps=2
reps=3
if [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ]; then steps=5; sleep_steps=1; reps=1; fi
bin="$DTRAIN_BUILD/bench/bench_pipeline"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1
parts=" ${DTRAIN_BENCH_PARTS:-a b c d} "
wants() { [[ "$parts" == *" $1 "* ]]; }
split_for() { if [ "$1" = interleaved ]; then echo 0,0,1,2,3,3; else echo 0,0,0,1,1,1; fi; }

if wants a; then
echo "# (a) calibrated-sleep stages"
"$bin" --mode sleep --ranks 4 --unit-ms "${DTRAIN_BENCH_UNIT_MS:-40}" --steps "$sleep_steps"
fi

if wants b; then
echo "# (b) GPT, p = 2, m = 4: step time (ms), dtrain vs torch.distributed.pipelining"
# Each case runs `reps` times, dtrain and torch alternating, so both sides see
# the same machine; a run's figure is its mean step (throughput), a case's the
# median over its runs (one run caught by a burst of other load does not
# decide it). Every run's pair is printed too.
for rep in $(seq "$reps"); do
  "$bin" --mode gpt --schedule none --steps "$steps" | grep '^{' | sed "s/^{/{\"case\":\"none\",\"rep\":$rep,/" >>"$tmp/dtrain_runs.jsonl"
  DTRAIN_LINEAR_KERNEL=aten "$bin" --mode gpt --schedule none --steps "$steps" | grep '^{' |
    sed "s/^{/{\"case\":\"none\",\"rep\":$rep,/" >>"$tmp/dtrain_aten_runs.jsonl"
  "$DTRAIN_PYTHON" "$here/peer.py" --schedule none --steps "$steps" | grep '^{' |
    sed "s/^{/{\"case\": \"none\", \"rep\": $rep, /" >>"$tmp/peer_runs.jsonl"
  for s in gpipe 1f1b interleaved zb; do
    "$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node 2 "$bin" --mode gpt --schedule "$s" --micro-batches 4 \
      --split "$(split_for "$s")" --steps "$steps" | grep '^{' | sed "s/^{/{\"case\":\"$s\",\"rep\":$rep,/" >>"$tmp/dtrain_runs.jsonl"
    DTRAIN_LINEAR_KERNEL=aten "$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node 2 "$bin" --mode gpt --schedule "$s" \
      --micro-batches 4 --split "$(split_for "$s")" --steps "$steps" | grep '^{' |
      sed "s/^{/{\"case\":\"$s\",\"rep\":$rep,/" >>"$tmp/dtrain_aten_runs.jsonl"
    "$DTRAIN_PYTHON" -m torch.distributed.run --nproc-per-node 2 --standalone "$here/peer.py" --schedule "$s" \
      --micro-batches 4 --split "$(split_for "$s")" --steps "$steps" 2>/dev/null | grep '^{' |
      sed "s/^{/{\"case\": \"$s\", \"rep\": $rep, /" >>"$tmp/peer_runs.jsonl"
  done
done
"$DTRAIN_PYTHON" - "$tmp" <<'PY'
import json, os, statistics, sys
tmp = sys.argv[1]
def runs(name):
    out = {}
    for r in map(json.loads, open(os.path.join(tmp, name))):
        out.setdefault(r["case"], []).append(r)
    return out
ours, theirs, aten = runs("dtrain_runs.jsonl"), runs("peer_runs.jsonl"), runs("dtrain_aten_runs.jsonl")
print("# every run: dtrain ms / dtrain on ATen's kernels ms / torch ms (ratios = dtrain's throughput over torch's)")
for case in ours:
    runs_of = zip(ours[case], aten.get(case, []), theirs.get(case, []))
    print(f"{case:12}" + "  ".join(f"{d['step_ms']:.1f} / {a['step_ms']:.1f} / {t['step_ms']:.1f} "
                                    f"({t['step_ms'] / d['step_ms']:.2f}x, {t['step_ms'] / a['step_ms']:.2f}x)"
                                    for d, a, t in runs_of))
def median_lines(runs_of, path):
    with open(path, "w") as f:
        for case, rs in runs_of.items():
            r = dict(min(rs, key=lambda r: abs(r["step_ms"] - statistics.median(x["step_ms"] for x in rs))))
            r["step_ms"] = statistics.median(x["step_ms"] for x in rs)
            r["tokens_per_second"] = round(r["batch"] * 64 * 1000 / r["step_ms"])
            r.pop("rep", None)
            f.write(json.dumps(r) + "\n")
median_lines(ours, os.path.join(tmp, "dtrain.jsonl"))
median_lines(theirs, os.path.join(tmp, "peer.jsonl"))
median_lines(aten, os.path.join(tmp, "dtrain_aten.jsonl"))
mine = {r["case"]: r for r in map(json.loads, open(os.path.join(tmp, "dtrain.jsonl")))}
peer = {r["case"]: r for r in map(json.loads, open(os.path.join(tmp, "peer.jsonl")))}
print("# medians")
mine_aten = {r["case"]: r for r in map(json.loads, open(os.path.join(tmp, "dtrain_aten.jsonl")))}
print(f"{'case':12}{'dtrain ms':>11}{'aten ms':>9}{'torch ms':>10}{'dtrain/unpipelined':>20}{'torch/unpipelined':>19}")
for case in mine:
    d, t = mine[case]["step_ms"], peer.get(case, {}).get("step_ms", float("nan"))
    a = mine_aten.get(case, {}).get("step_ms", float("nan"))
    print(f"{case:12}{d:11.1f}{a:9.1f}{t:10.1f}{mine['none']['step_ms'] / d:20.2f}x{peer['none']['step_ms'] / t:18.2f}x")
PY
echo "# dtrain 1F1B with activations and gradients through Gloo instead of shared memory"
"$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node 2 "$bin" --mode gpt --schedule 1f1b --micro-batches 4 \
  --split "$(split_for 1f1b)" --steps "$steps" --transport gloo | grep '^{'
echo "# comparisons (ratio > 1: dtrain better)"
"$DTRAIN_PYTHON" "$here/../common/compare.py" --bench pipeline --dtrain "$tmp/dtrain.jsonl" --peer "$tmp/peer.jsonl" \
  --dtrain-aten "$tmp/dtrain_aten.jsonl" --metric tokens_per_second:higher
fi

if wants c; then
echo "# (c) DP x PP 2 x 2, examples/gpt: tokens/s per data-parallel reduction of the stages"
mesh_steps=40
for r in ddp zero1 zero2 allreduce; do
  "$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node 4 "$DTRAIN_BUILD/examples/gpt" --strategy pipeline --pp-size 2 \
    --dp-reduce "$r" --micro-batches 4 --batch-size 8 --max-iters "$mesh_steps" --eval-interval 100000 \
    --eval-iters 1 --sample-tokens 0 2>/dev/null | grep '"done"' |
    "$DTRAIN_PYTHON" -c 'import json, sys
d = json.loads(sys.stdin.read())
print(json.dumps({"bench": "pipeline", "case": "mesh2x2_" + d["dp_reduce"], "tokens_per_second": round(d["tokens_per_second"]), "val_loss": round(d["val_loss"], 5)}))'
done
fi

if wants d; then
echo "# (d) ZeRO-3 x PP 2 x 2 (GPT of (b), 1F1B, m = 4): dtrain vs FSDP2 inside torch.distributed.pipelining"
: >"$tmp/z3_dtrain.jsonl"
: >"$tmp/z3_dtrain_aten.jsonl"
: >"$tmp/z3_peer.jsonl"
for rep in $(seq "$reps"); do
  "$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node 4 "$bin" --mode gpt --schedule 1f1b --micro-batches 4 \
    --split "$(split_for 1f1b)" --steps "$steps" --dp-shard 2 2>/dev/null | grep '^{' >>"$tmp/z3_dtrain.jsonl"
  DTRAIN_LINEAR_KERNEL=aten "$DTRAIN_BUILD/tools/dtrain" run --nproc-per-node 4 "$bin" --mode gpt --schedule 1f1b \
    --micro-batches 4 --split "$(split_for 1f1b)" --steps "$steps" --dp-shard 2 2>/dev/null | grep '^{' \
    >>"$tmp/z3_dtrain_aten.jsonl"
  "$DTRAIN_PYTHON" -m torch.distributed.run --nproc-per-node 4 --standalone "$here/peer.py" --schedule 1f1b \
    --micro-batches 4 --split "$(split_for 1f1b)" --steps "$steps" --dp-shard 2 2>/dev/null | grep '^{' \
    >>"$tmp/z3_peer.jsonl"
done
"$DTRAIN_PYTHON" - "$tmp" "$here/../common" <<'PY'
import json, os, statistics, sys
tmp = sys.argv[1]
sys.path.insert(0, sys.argv[2])
from machine import machine
med = lambda name: statistics.median(json.loads(l)["step_ms"] for l in open(os.path.join(tmp, name)))
d, a, t = med("z3_dtrain.jsonl"), med("z3_dtrain_aten.jsonl"), med("z3_peer.jsonl")
print(json.dumps({"bench": "pipeline", "case": "zero3_pp2x2_1f1b", "dtrain_step_ms": round(d, 1),
                  "dtrain_aten_step_ms": round(a, 1), "torch_fsdp2_pipelining_step_ms": round(t, 1),
                  "ratio": round(t / d, 2), "ratio_like_for_like": round(t / a, 2), "machine": machine()}))
PY
fi
