#!/usr/bin/env bash
# dtrain::DataParallel against LibTorch's data_parallel on the same replicas,
# and against one replica (one intra-op thread, and one per replica).
# Arguments go to the program: [--steps 60] [--devices cpu,cpu].
set -euo pipefail
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
OMP_NUM_THREADS=1 "$DTRAIN_BUILD/bench/bench_data_parallel" "$@" | tee "$tmp/all.jsonl"
echo "# comparisons (ratio > 1: dtrain_dp better; step time p50)"
"$DTRAIN_PYTHON" - "$tmp/all.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for case in dict.fromkeys(r["case"] for r in rows):
    mine = next(r for r in rows if r["case"] == case and r["impl"] == "dtrain_dp")
    for peer in (r for r in rows if r["case"] == case and r["impl"] != "dtrain_dp"):
        if "error" in peer:
            print(json.dumps({"bench": "data_parallel", "case": case, "metric": "p50_ms", "dtrain": mine["p50_ms"],
                              "peer": None, "peer_name": peer["impl"], "ratio": None, "note": "peer does not run: " + peer["error"]}))
            continue
        print(json.dumps({"bench": "data_parallel", "case": case, "metric": "p50_ms", "dtrain": mine["p50_ms"],
                          "peer": peer["p50_ms"], "peer_name": peer["impl"], "ratio": round(peer["p50_ms"] / mine["p50_ms"], 3)}))
PY
