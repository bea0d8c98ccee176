"""bench gpt's scaling case: reads the lines of its rounds (per round, dtrain's
bench_pipeline and then torch's bench/pipeline/peer.py: one process, 2-rank
lockstep, 2-rank DDP each) and prints each round's tokens/s and ratios per
side, then one JSON line with the medians:

    {"bench": "gpt", "case": "scaling", "ceiling": lockstep / (2 x single),
     "efficiency": ddp / (2 x single), "ddp_over_lockstep": ddp / lockstep,
     "rounds": N, "peer": {the same three for torch}, "machine": {...}}

ceiling is what the machine allows a synchronous 2-rank step (contention and
the wait for the slower rank); ddp_over_lockstep is what a DDP costs beyond it
(its gradient all-reduce and bookkeeping): dtrain's against torch's, the two
distributed layers compared apart from their kernels and the machine."""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from machine import machine  # noqa: E402


def side_of(line):
    return "dtrain" if line.get("impl") == "dtrain" else "torch"


def ratios(runs, name):
    """Per round (single, lockstep, ddp) -> the three ratios' medians, printing each round."""
    n = min(len(v) for v in runs.values())
    if n == 0:
        sys.exit(f"bench gpt scaling: a {name} round produced no result (see the errors above)")
    ceiling, efficiency, own = [], [], []
    for i in range(n):
        s, lock, ddp = runs["none"][i], runs["lockstep"][i], runs["ddp"][i]
        ceiling.append(lock / (2 * s))
        efficiency.append(ddp / (2 * s))
        own.append(ddp / lock)
        print(f"{name:>6} {i + 1:>5} {s:>8.0f} {lock:>9.0f} {ddp:>8.0f} {ceiling[-1]:>8.3f} {efficiency[-1]:>10.3f} "
              f"{own[-1]:>12.3f}")
    return n, {"ceiling": round(statistics.median(ceiling), 3), "efficiency": round(statistics.median(efficiency), 3),
               "ddp_over_lockstep": round(statistics.median(own), 3)}


def main():
    lines = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
    runs = {side: {"none": [], "lockstep": [], "ddp": []} for side in ("dtrain", "torch")}
    for line in lines:
        runs[side_of(line)][line.get("data_parallel", "none")].append(line["tokens_per_second"])
    print(f"{'side':>6} {'round':>5} {'single':>8} {'lockstep':>9} {'ddp':>8} {'ceiling':>8} {'efficiency':>10} "
          f"{'ddp/lockstep':>12}")
    n, ours = ratios(runs["dtrain"], "dtrain")
    _, peer = ratios(runs["torch"], "torch")
    print(json.dumps({"bench": "gpt", "case": "scaling", **ours, "rounds": n, "peer": peer, "machine": machine()}))


if __name__ == "__main__":
    main()
