"""The Python peer of bench/collectives/collectives_bench.cpp: torch.distributed
(gloo) all_reduce, reduce_scatter_tensor and all_gather_into_tensor, same
sizes, iterations, timing and output format."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from torch_exit import exit_without_teardown  # noqa: E402

SIZES = [("4KiB", 4 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20), ("64MiB", 64 << 20)]
OPS = ["all_reduce", "reduce_scatter", "all_gather"]


def percentile(values, p):
    values = sorted(values)
    return values[int(p * (len(values) - 1))]


def iterations(nbytes):
    if nbytes <= 64 << 10:
        return 200
    if nbytes <= 1 << 20:
        return 60
    if nbytes <= 16 << 20:
        return 20
    return 10


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for op in OPS:
        for name, nbytes in SIZES:
            floats = nbytes // 4
            full = torch.ones(floats)
            part = torch.ones(floats // world)
            if op == "all_reduce":
                def once():
                    dist.all_reduce(full)
            elif op == "reduce_scatter":
                def once():
                    dist.reduce_scatter_tensor(part, full)
            else:
                def once():
                    dist.all_gather_into_tensor(full, part)
            iters = iterations(nbytes)
            for _ in range(max(3, iters // 10)):
                once()
            ms = []
            for _ in range(iters):
                dist.barrier()
                start = time.perf_counter()
                once()
                ms.append((time.perf_counter() - start) * 1e3)
            if dist.get_rank() == 0:
                print(json.dumps({"impl": "torch.distributed", "case": f"{op}_{name}", "op": op, "bytes": nbytes,
                                  "p50_ms": round(percentile(ms, 0.5), 4), "p95_ms": round(percentile(ms, 0.95), 4),
                                  "iters": iters}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
