"""torch.mm from Python on the shapes of bench/matmul/matmul_bench.cpp (the
GPT's Linears at 12 x 64 tokens, width 128: forward, dx, dW), one thread:
what a PyTorch program's Linears run on. One JSON line per case."""
import json
import time

import torch


def median_us(f, warmup=20, reps=15, inner=20):
    for _ in range(warmup):
        f()
    us = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            f()
        us.append((time.perf_counter() - t) * 1e6 / inner)
    return sorted(us)[len(us) // 2]


def main():
    torch.set_num_threads(1)
    tokens, width = 12 * 64, 128
    cases = []
    for layer, n_in, n_out in [("attn", width, 3 * width), ("proj", width, width), ("fc", width, 4 * width),
                               ("mlp_proj", 4 * width, width), ("head", width, 65)]:
        x, w, dy = torch.randn(tokens, n_in), torch.randn(n_out, n_in), torch.randn(tokens, n_out)
        cases += [(layer + ".fwd", x, w.t()), (layer + ".dx", dy, w), (layer + ".dw", dy.t(), x)]
    for name, a, b in cases:
        us = median_us(lambda: torch.mm(a, b))
        flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        print(json.dumps({"case": name, "impl": "torch.mm", "us": round(us, 1), "gflops": round(flops / us / 1e3, 1)}))


if __name__ == "__main__":
    main()
