#!/usr/bin/env bash
# dtrain tensor parallelism against PyTorch's DTensor TP (parallelize_module,
# bench/tp/peer.py) on examples/gpt's GPT at width 256 (4 layers, 8 heads,
# batch 8 x 64 tokens per step), 2 ranks = tp 2, CPU, gloo, one OpenMP
# thread each; plain TP and TP + sequence parallelism; three rounds
# interleaved so load drifts hit both sides alike; the best p50 of the rounds
# per case. Set DTRAIN_BENCH_QUICK=1 for fewer steps. Extra arguments go to
# both sides (e.g. --n-embd 512).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../common/launch.sh"
ranks=2 steps=30
if [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ]; then steps=8; fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
: >"$tmp/all.jsonl"
for round in 1 2 3; do
  for sp in "" --sequence-parallel; do
    launch_ranks "$ranks" "$tmp/one.jsonl" "$DTRAIN_BUILD/bench/bench_tp" --steps "$steps" $sp "$@"
    cat "$tmp/one.jsonl" >>"$tmp/all.jsonl"
    launch_ranks "$ranks" "$tmp/one.jsonl" "$DTRAIN_PYTHON" "$here/peer.py" --steps "$steps" $sp "$@"
    cat "$tmp/one.jsonl" >>"$tmp/all.jsonl"
  done
done
echo "# raw results (rank 0 of $ranks)"
cat "$tmp/all.jsonl"
"$DTRAIN_PYTHON" - "$tmp/all.jsonl" <<'PY'
import json, sys
best = {}
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        k = (r["impl"], r["case"])
        if k not in best or r["p50_ms"] < best[k]["p50_ms"]:
            best[k] = r
for case in sorted({c for _, c in best}):
    d, p = best.get(("dtrain", case)), best.get(("torch_dtensor", case))
    if d and p:
        print(f"# {case}: dtrain {d['tokens_per_s']:.0f} tokens/s ({d['p50_ms']:.1f} ms/step), DTensor "
              f"{p['tokens_per_s']:.0f} tokens/s ({p['p50_ms']:.1f} ms/step); losses first {d['first_loss']:.5f} / "
              f"{p['first_loss']:.5f}, last {d['last_loss']:.5f} / {p['last_loss']:.5f}")
        print(json.dumps({"bench": "tp", "case": case, "metric": "tokens_per_s", "dtrain": d["tokens_per_s"],
                          "peer": p["tokens_per_s"], "peer_name": "torch_dtensor",
                          "ratio": round(d["tokens_per_s"] / p["tokens_per_s"], 3)}))
PY
