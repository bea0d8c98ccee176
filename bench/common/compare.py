"""Pairs dtrain's and the peer's result lines and prints the benchmark
convention: one JSON object per comparison,
  {"bench", "case", "metric", "dtrain", "peer", "peer_name", "ratio"}
with ratio > 1 meaning dtrain is better (for lower-is-better metrics,
ratio = peer / dtrain)."""
import argparse
import json


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--dtrain", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--metric", action="append", required=True, help="NAME:lower or NAME:higher")
    args = ap.parse_args()
    ours = {r["case"]: r for r in load(args.dtrain)}
    theirs = {r["case"]: r for r in load(args.peer)}
    for case, mine in ours.items():
        peer = theirs.get(case)
        if peer is None:
            continue
        for spec in args.metric:
            metric, better = spec.split(":")
            d, p = float(mine[metric]), float(peer[metric])
            ratio = (p / d if better == "lower" else d / p) if d and p else None
            print(json.dumps({"bench": args.bench, "case": case, "metric": metric, "dtrain": d, "peer": p,
                              "peer_name": peer["impl"], "ratio": None if ratio is None else round(ratio, 3)}))


if __name__ == "__main__":
    main()
