#!/usr/bin/env bash
# Save and load throughput of a 1 GiB safetensors file (64 float32 tensors of
# 16 MiB): dtrain's save_safetensors / load_safetensors against Python's
# safetensors.torch save_file / load_file, one intra-op thread, in turn, two
# rounds; each case keeps its best (this machine is shared). Loads include
# reading every byte once (a sum per tensor). The files sit in the page cache.
# Then a sharded checkpoint saved and loaded by 4 ranks: dtrain's ZeRO-3
# ShardedCheckpointer (sharded_bench.cpp) against FSDP2 with dcp.save/dcp.load
# (sharded_peer.py), same model (16 Linear 1024x1024) and AdamW state.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rounds="${DTRAIN_BENCH_ROUNDS:-2}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for ((r = 0; r < rounds; r++)); do
  OMP_NUM_THREADS=1 "$DTRAIN_BUILD/bench/bench_checkpoint_io" "$tmp" >>"$tmp/dtrain_all.jsonl"
  OMP_NUM_THREADS=1 "$DTRAIN_PYTHON" "$here/peer.py" "$tmp" >>"$tmp/peer_all.jsonl"
  # A sharded checkpoint of 4 ranks: ZeRO-3 (ShardedCheckpointer) against FSDP2 + DCP.
  OMP_NUM_THREADS=1 "$DTRAIN_BUILD/bench/bench_checkpoint_io_sharded" "$tmp" >>"$tmp/dtrain_all.jsonl"
  OMP_NUM_THREADS=1 "$DTRAIN_PYTHON" "$here/sharded_peer.py" "$tmp" >>"$tmp/peer_all.jsonl"
done
echo "# raw results, every round"
cat "$tmp/dtrain_all.jsonl" "$tmp/peer_all.jsonl"
"$DTRAIN_PYTHON" - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
for side in ("dtrain", "peer"):
    best = {}
    for r in map(json.loads, open(f"{tmp}/{side}_all.jsonl")):
        if r["case"] not in best or r["seconds"] < best[r["case"]]["seconds"]:
            best[r["case"]] = r
    with open(f"{tmp}/{side}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in best.values())
PY
echo "# comparisons: dtrain vs safetensors.torch, GB/s (higher is better)"
"$DTRAIN_PYTHON" "$here/../common/compare.py" --bench checkpoint_io --dtrain "$tmp/dtrain.jsonl" \
  --peer "$tmp/peer.jsonl" --metric gb_per_s:higher
