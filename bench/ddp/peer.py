"""The Python peer of bench/ddp/ddp_bench.cpp: torch DDP (gloo), same models,
data shapes, steps and measurements, same output format."""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from torch_exit import exit_without_teardown  # noqa: E402


def percentile(values, p):
    values = sorted(values)
    return values[int(p * (len(values) - 1))]


def make_model(name):
    if name == "small":
        return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10)), 784
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 10)), 1024


def ms_since(t):
    return (time.perf_counter() - t) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=["small", "large"])
    ap.add_argument("--bucket-cap-mb", type=float, default=25)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-view", action="store_true")
    # Names the case in which dtrain also all-reduces through Gloo (torch always does).
    ap.add_argument("--gloo", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, in_features = make_model(args.model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb,
                                  gradient_as_bucket_view=args.bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, in_features, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    numel = sum(p.numel() for p in model.parameters())

    step_ms, backward_ms = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        backward_start = time.perf_counter()
        loss.backward()
        backward = ms_since(backward_start)
        opt.step()
        if i >= args.warmup:
            step_ms.append(ms_since(start))
            backward_ms.append(backward)
    probes = max(5, args.steps // 4)
    local_ms, allreduce_ms = [], []
    with ddp.no_sync():
        for _ in range(probes):
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            start = time.perf_counter()
            loss.backward()
            local_ms.append(ms_since(start))
    flat = torch.zeros(numel)
    for _ in range(probes):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        allreduce_ms.append(ms_since(start))
    dist.barrier()
    if rank == 0:
        local, comm, ddp_bwd = percentile(local_ms, 0.5), percentile(allreduce_ms, 0.5), percentile(backward_ms, 0.5)
        hidden = min(1.0, max(0.0, (local + comm - ddp_bwd) / comm))
        print(json.dumps({"impl": "torch DDP", "case": f"{args.model}_mlp_cap{args.bucket_cap_mb:g}MB{'_view' if args.bucket_view else ''}{'_gloo' if args.gloo else ''}",
                          "params": numel, "p50_ms": round(percentile(step_ms, 0.5), 3),
                          "p95_ms": round(percentile(step_ms, 0.95), 3), "backward_local_ms": round(local, 3),
                          "allreduce_ms": round(comm, 3), "backward_ddp_ms": round(ddp_bwd, 3),
                          "hidden_fraction": round(hidden, 3)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
