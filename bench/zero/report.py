"""Prints bench/zero's tables and comparison lines from the raw results of
run.sh (report.py DTRAIN PEER [DTRAIN_ATEN]): per case the best (lowest p50)
of the rounds; memory beside the formula; then
{"bench","case","metric","dtrain","peer","peer_name","ratio","machine"} lines
(ratio > 1: dtrain better). With DTRAIN_ATEN (dtrain's runs with
DTRAIN_LINEAR_KERNEL=aten) the comparisons with a peer also carry
"dtrain_aten" and "ratio_like_for_like": the same peer against dtrain on
ATen's kernels."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from machine import machine  # noqa: E402


def load(path):
    best = {}
    if path is None:
        return best
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r["case"] not in best or r["p50_ms"] < best[r["case"]]["p50_ms"]:
                best[r["case"]] = r
    return best


ours, peers = load(sys.argv[1]), load(sys.argv[2])
aten = load(sys.argv[3] if len(sys.argv) > 3 else None)
where = machine()
print("# memory per rank: parameters (peak during forward/backward) + gradients + optimizer state (MB, measured);")
print("# resident: with the parameters held between steps (stage 3: shards only); formula: fp32 AdamW's,")
print("# for _bf16 mixed-precision Adam's (ZeRO paper: 4P + 12P/N, 2P + 14P/N, 16P/N)")
CASES = ("ddp", "zero1", "zero2", "zero3", "zero1_bf16", "zero2_bf16", "zero3_bf16", "hsdp2x2")
for case in CASES:
    r = ours.get(case)
    if r:
        mb = lambda b: b / 2**20  # noqa: E731
        print(f"{case:10s} params {mb(r['param_bytes']):6.2f}  grads {mb(r['grad_bytes']):6.2f}  "
              f"optimizer {mb(r['optimizer_bytes']):6.2f}  peak {mb(r['peak_bytes']):6.2f}  "
              f"resident {mb(r['resident_bytes']):6.2f}  formula {mb(r['formula_bytes']):6.2f}  "
              f"resident/formula {r['resident_bytes'] / r['formula_bytes']:.3f}  peak/formula {r['peak_bytes'] / r['formula_bytes']:.3f}")
print("# step time p50 (ms): " + ", ".join(f"dtrain {c} {r['p50_ms']:.1f}" for c, r in ours.items()) + ", " +
      "".join(f"dtrain on ATen's kernels {c} {r['p50_ms']:.1f}, " for c, r in aten.items()) +
      ", ".join(f"{r['impl']} {r['p50_ms']:.1f}" for r in peers.values()))


def line(case, metric, d, p, peer_name, aten_d=None, against_peer=False):
    out = {"bench": "zero", "case": case, "metric": metric, "dtrain": d, "peer": p, "peer_name": peer_name,
           "ratio": round(p / d, 3) if d and p else None}
    if aten and against_peer:  # dtrain's own baselines and the formula have no like-for-like twin
        out.update(dtrain_aten=aten_d, ratio_like_for_like=round(p / aten_d, 3) if aten_d and p else None)
    out["machine"] = where
    print(json.dumps(out))


pairs = [("ddp", "ddp"), ("zero3", "fsdp2"), ("zero2", "fsdp2"), ("zero1", "zero_redundancy"), ("hsdp2x2", "hsdp2x2")]
for mine, theirs in pairs:
    if mine in ours and theirs in peers:
        line(mine, "p50_ms", ours[mine]["p50_ms"], peers[theirs]["p50_ms"], peers[theirs]["impl"],
             aten.get(mine, {}).get("p50_ms"), against_peer=True)
for case in CASES[1:-1]:  # against dtrain's own DDP on 2 ranks: ratio = ddp / zero
    if case in ours and "ddp" in ours:
        line(case, "p50_ms_vs_dtrain_ddp", ours[case]["p50_ms"], ours["ddp"]["p50_ms"], "dtrain_ddp")
for case in CASES:  # memory: ratio = formula / measured
    if case in ours:
        line(case, "resident_bytes_vs_formula", ours[case]["resident_bytes"], ours[case]["formula_bytes"], "formula")
        line(case, "peak_bytes_vs_formula", ours[case]["peak_bytes"], ours[case]["formula_bytes"], "formula")
