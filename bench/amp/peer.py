"""The Python peer of bench/amp/amp_bench.cpp: the same model, data shapes,
loop (torch.autocast("cpu", torch.bfloat16) + torch.amp.GradScaler("cpu")),
measurements and output format."""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

IN, HIDDEN, CLASSES = 1024, 4096, 16


def percentile(values, p):
    values = sorted(values)
    return values[int(p * (len(values) - 1))]


def ms_since(t):
    return (time.perf_counter() - t) * 1e3


def train_case(bf16, steps, warmup, batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, IN), nn.ReLU(), nn.Linear(IN, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=bf16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, IN, generator=gen)
    y = torch.randint(0, CLASSES, (batch,), generator=gen)
    numel = sum(p.numel() for p in model.parameters())
    step_ms, loss_value = [], 0.0
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if i >= warmup:
            step_ms.append(ms_since(start))
        loss_value = loss.item()
    print(json.dumps({"impl": "torch", "case": f"mlp_{'bf16' if bf16 else 'fp32'}", "params": numel, "batch": batch,
                      "p50_ms": round(percentile(step_ms, 0.5), 3), "p95_ms": round(percentile(step_ms, 0.95), 3),
                      "final_loss": round(loss_value, 4)}), flush=True)


def mm_case(bf16, steps, batch):
    gen = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16 if bf16 else torch.float32
    a = torch.randn(batch, HIDDEN, generator=gen).to(dtype)
    b = torch.randn(HIDDEN, HIDDEN, generator=gen).to(dtype)
    ms = []
    for i in range(steps + 3):
        start = time.perf_counter()
        torch.mm(a, b)
        if i >= 3:
            ms.append(ms_since(start))
    p50 = percentile(ms, 0.5)
    print(json.dumps({"impl": "torch", "case": f"mm_{'bf16' if bf16 else 'fp32'}", "p50_ms": round(p50, 3),
                      "gflops": round(2.0 * batch * HIDDEN * HIDDEN / (p50 * 1e6), 1)}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", default="all", choices=["all", "fp32", "bf16", "mm"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode in ("all", "mm"):
        mm_case(False, args.steps, args.batch)
        mm_case(True, args.steps, args.batch)
    if args.mode in ("all", "fp32"):
        train_case(False, args.steps, args.warmup, args.batch)
    if args.mode in ("all", "bf16"):
        train_case(True, args.steps, args.warmup, args.batch)


if __name__ == "__main__":
    main()
