"""The Python peer of bench/allreduce/allreduce.cpp: torch.distributed (gloo)
all-reduce latency, same sizes, iterations and output format."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from torch_exit import exit_without_teardown  # noqa: E402

CASES = [("4KiB", 1024), ("1MiB", 256 * 1024), ("16MiB", 4 * 1024 * 1024)]


def percentile(values, p):
    values = sorted(values)
    return values[int(p * (len(values) - 1))]


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name, floats in CASES:
        t = torch.ones(floats)
        iters = 30 if floats >= 1 << 20 else 200
        for _ in range(10):
            dist.all_reduce(t)
        dist.barrier()
        us = []
        for _ in range(iters):
            start = time.perf_counter()
            dist.all_reduce(t)
            us.append((time.perf_counter() - start) * 1e6)
        if dist.get_rank() == 0:
            print(json.dumps({"impl": "torch.distributed", "case": name, "bytes": floats * 4,
                              "p50_us": round(percentile(us, 0.5), 1), "p95_us": round(percentile(us, 0.95), 1),
                              "iters": iters}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
