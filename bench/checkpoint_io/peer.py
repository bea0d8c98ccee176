"""Python's safetensors.torch on the same workload as safetensors_bench.cpp:
save_file, then load_file and a sum over every tensor (reads every byte)."""
import json
import os
import sys
import time

import torch
from safetensors.torch import load_file, save_file

folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
count = int(sys.argv[2]) if len(sys.argv) > 2 else 64
tensors = {f"layer.{i}": torch.randn(4 * 1024 * 1024) for i in range(count)}
gb = count * 4 * 1024 * 1024 * 4 / 1e9
path = os.path.join(folder, "peer_bench.safetensors")


def report(case, seconds):
    print(json.dumps({"impl": "safetensors.torch", "case": case, "seconds": round(seconds, 4),
                      "gb_per_s": round(gb / seconds, 3)}), flush=True)


t = time.perf_counter()
save_file(tensors, path)
report("save", time.perf_counter() - t)
t = time.perf_counter()
total = sum(float(v.sum()) for v in load_file(path).values())
report("load_and_read", time.perf_counter() - t)
os.remove(path)
