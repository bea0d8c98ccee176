"""bench/ab's table and JSON lines from its raw results (one JSON object per run)."""
import json
import statistics
import sys
from collections import defaultdict

# The peer each case is compared with (bench zero's report.py pairs ZeRO-1 with
# ZeroRedundancyOptimizer and ZeRO-2/3 with FSDP2).
ZERO_PEER = {"ddp": "ddp", "zero1": "zero_redundancy", "zero2": "fsdp2", "zero3": "fsdp2"}


def throughput(r):
    """Higher is better: tokens/s for gpt, steps/s for the others."""
    if r["bench"] == "gpt":
        return r["tokens_per_second"]
    return 1000.0 / (r["step_ms"] if r["bench"] == "pipeline" else r["p50_ms"])


runs = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[(r["bench"], r["case"], r["side"])].append(throughput(r))
med = {k: statistics.median(v) for k, v in runs.items()}
print(f"{'bench':9}{'case':12}{'old':>10}{'new':>10}{'new/old':>9}{'peer':>10}{'old/peer':>10}{'new/peer':>10}")
for bench, case, side in sorted(k for k in med if k[2] == "new"):
    old, new = med.get((bench, case, "old")), med[(bench, case, "new")]
    peer_case = ZERO_PEER[case] if bench == "zero" else case
    peer = med.get((bench, peer_case, "torch"))
    line = {"bench": "ab", "case": f"{bench}_{case}", "metric": "tokens_per_second" if bench == "gpt" else "steps_per_second",
            "old": round(old, 2), "new": round(new, 2), "new_over_old": round(new / old, 3), "runs": len(runs[(bench, case, "new")])}
    if peer:
        line.update(peer=round(peer, 2), peer_case=peer_case, old_ratio=round(old / peer, 3), new_ratio=round(new / peer, 3))
    print(f"{bench:9}{case:12}{old:10.2f}{new:10.2f}{new / old:9.3f}{(peer or float('nan')):10.2f}"
          f"{(old / peer if peer else float('nan')):10.3f}{(new / peer if peer else float('nan')):10.3f}")
    print(json.dumps(line))
