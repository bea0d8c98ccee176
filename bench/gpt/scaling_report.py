"""bench gpt's scaling case: reads the bench_pipeline lines of its rounds (one
process, 2-rank lockstep, 2-rank DDP, in that order per round) and prints each
round's tokens/s and ratios, then one JSON line with the medians:

    {"bench": "gpt", "case": "scaling", "ceiling": lockstep / (2 x single),
     "efficiency": ddp / (2 x single), "ddp_over_lockstep": ddp / lockstep,
     "rounds": N, "machine": {...}}

ceiling is what the machine allows a synchronous 2-rank step (contention and
the wait for the slower rank); ddp_over_lockstep is what dtrain's DDP costs
beyond it (its gradient all-reduce and bookkeeping)."""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from machine import machine  # noqa: E402


def main():
    lines = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
    rounds = {"none": [], "lockstep": [], "ddp": []}
    for line in lines:
        rounds[line.get("data_parallel", "none")].append(line["tokens_per_second"])
    n = min(len(v) for v in rounds.values())
    if n == 0:
        sys.exit("bench gpt scaling: a round produced no result (see the errors above)")
    ceiling, efficiency, own = [], [], []
    print(f"{'round':>5} {'single':>8} {'lockstep':>9} {'ddp':>8} {'ceiling':>8} {'efficiency':>10} {'ddp/lockstep':>12}")
    for i in range(n):
        s, lock, ddp = rounds["none"][i], rounds["lockstep"][i], rounds["ddp"][i]
        ceiling.append(lock / (2 * s))
        efficiency.append(ddp / (2 * s))
        own.append(ddp / lock)
        print(f"{i + 1:>5} {s:>8.0f} {lock:>9.0f} {ddp:>8.0f} {ceiling[-1]:>8.3f} {efficiency[-1]:>10.3f} {own[-1]:>12.3f}")
    print(json.dumps({"bench": "gpt", "case": "scaling", "ceiling": round(statistics.median(ceiling), 3),
                      "efficiency": round(statistics.median(efficiency), 3),
                      "ddp_over_lockstep": round(statistics.median(own), 3), "rounds": n, "machine": machine()}))


if __name__ == "__main__":
    main()
