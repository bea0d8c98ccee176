"""The Python twin of bench/launcher/worker.cpp, for torchrun launching a
native Python worker: join the group (gloo), one all-reduce as the first
step, record the time in $BENCH_DIR/step_<restart>_<rank>, then wait to be
killed in the first round."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1024)
dist.all_reduce(t)
now = time.time_ns()
round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
path = os.path.join(os.environ["BENCH_DIR"], f"step_{round_}_{dist.get_rank()}")
with open(path + ".tmp", "w") as f:
    f.write(f"{now}\n")
os.rename(path + ".tmp", path)
if round_ == "0":
    time.sleep(120)
