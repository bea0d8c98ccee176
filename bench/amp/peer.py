"""The Python peer of bench/amp/amp_bench.cpp: the same model, data shapes,
loops (fp32, and torch.autocast("cpu", torch.bfloat16) + torch.amp.GradScaler("cpu"))
alternating in blocks of steps, measurements and output format."""
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


class Loop:
    def __init__(self, bf16):
        torch.manual_seed(0)
        self.bf16 = bf16
        self.model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                   nn.Linear(HIDDEN, IN), nn.ReLU(), nn.Linear(IN, CLASSES))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.scaler = torch.amp.GradScaler("cpu", enabled=bf16)
        self.ms, self.last_loss = [], 0.0

    def step(self, x, y):
        start = time.perf_counter()
        self.opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss = F.cross_entropy(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        ms = ms_since(start)
        self.last_loss = loss.item()
        return ms


def train_cases(steps, warmup, batch, block):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, IN, generator=gen)
    y = torch.randint(0, CLASSES, (batch,), generator=gen)
    loops = [Loop(False), Loop(True)]
    for loop in loops:
        for _ in range(warmup):
            loop.step(x, y)
    for done in range(0, steps, block):
        for loop in loops:
            for _ in range(done, min(steps, done + block)):
                loop.ms.append(loop.step(x, y))
    numel = sum(p.numel() for p in loops[0].model.parameters())
    for loop in loops:
        print(json.dumps({"impl": "torch", "case": f"mlp_{'bf16' if loop.bf16 else 'fp32'}", "params": numel,
                          "batch": batch, "p50_ms": round(percentile(loop.ms, 0.5), 3),
                          "p95_ms": round(percentile(loop.ms, 0.95), 3), "final_loss": round(loop.last_loss, 4)}),
              flush=True)


def mm_cases(steps, batch):
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(batch, HIDDEN, generator=gen)
    b = torch.randn(HIDDEN, HIDDEN, generator=gen)
    pairs = [(a, b), (a.bfloat16(), b.bfloat16())]
    ms = [[], []]
    for i in range(steps + 3):
        for k, (p, q) in enumerate(pairs):
            start = time.perf_counter()
            torch.mm(p, q)
            if i >= 3:
                ms[k].append(ms_since(start))
    for k, name in enumerate(("fp32", "bf16")):
        p50 = percentile(ms[k], 0.5)
        print(json.dumps({"impl": "torch", "case": f"mm_{name}", "p50_ms": round(p50, 3),
                          "gflops": round(2.0 * batch * HIDDEN * HIDDEN / (p50 * 1e6), 1)}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mm_cases(args.steps, args.batch)
    train_cases(args.steps, args.warmup, args.batch, max(1, args.block))


if __name__ == "__main__":
    main()
