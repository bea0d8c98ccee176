"""Pairs dtrain's and the peer's result lines and prints the benchmark
convention: one JSON object per comparison,
  {"bench", "case", "metric", "dtrain", "peer", "peer_name", "ratio", "machine"}
with ratio > 1 meaning dtrain is better (for lower-is-better metrics,
ratio = peer / dtrain) and machine the CPU it ran on (machine.py).

--dtrain-aten FILE: dtrain's results with DTRAIN_LINEAR_KERNEL=aten (its
Linears on ATen's at::linear, the kernel the peer runs); each line then also
carries "dtrain_aten" and "ratio_like_for_like" (that run against the same
peer): ratio / ratio_like_for_like is what dtrain's own kernel buys, and
ratio_like_for_like what the rest of dtrain (the distributed layer, the
step's overheads) buys."""
import argparse
import json

from machine import machine


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def ratio_of(d, p, better):
    if not d or not p:
        return None
    return round(p / d if better == "lower" else d / p, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--dtrain", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--dtrain-aten", help="dtrain's results with DTRAIN_LINEAR_KERNEL=aten")
    ap.add_argument("--metric", action="append", required=True, help="NAME:lower or NAME:higher")
    args = ap.parse_args()
    ours = {r["case"]: r for r in load(args.dtrain)}
    aten = {r["case"]: r for r in load(args.dtrain_aten)} if args.dtrain_aten else {}
    theirs = {r["case"]: r for r in load(args.peer)}
    where = machine()
    for case, mine in ours.items():
        peer = theirs.get(case)
        if peer is None:
            continue
        for spec in args.metric:
            metric, better = spec.split(":")
            d, p = float(mine[metric]), float(peer[metric])
            line = {"bench": args.bench, "case": case, "metric": metric, "dtrain": d, "peer": p,
                    "peer_name": peer["impl"], "ratio": ratio_of(d, p, better)}
            if args.dtrain_aten:
                a = float(aten[case][metric]) if case in aten else None
                line.update(dtrain_aten=a, ratio_like_for_like=ratio_of(a, p, better) if a is not None else None)
            line["machine"] = where
            print(json.dumps(line))


if __name__ == "__main__":
    main()
