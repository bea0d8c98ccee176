"""A plain PyTorch DDP program that knows nothing of dtrain: torch's env://
rendezvous, gloo, a small model in DistributedDataParallel, a few steps on
rank-dependent data, then every rank checks that all replicas hold the same
parameters and writes them to $PLAIN_DDP_DIR/result_<rank>.json.

Fault injection: with PLAIN_DDP_FAIL_RANK=R, rank R exits with code 1 in the
first attempt (TORCHELASTIC_RESTART_COUNT=0), after joining the group, so the
launcher must restart the whole group.

The process ends with os._exit(0) once its result file is in place. With
torch 2.15 a gloo DDP process otherwise sometimes aborts in interpreter
teardown ("terminate called without an active exception"), after its work
is done: a gloo worker thread lets go of the finished all_gather, whose
output tensors' Python objects have already died, so it must take the GIL,
and a thread that asks for the GIL during finalization is torn down through
a noexcept frame (pytorch/pytorch#190489; core dumps show
AsyncAllgatherWork::~AsyncAllgatherWork in ProcessGroupGloo::runLoop).
dist.destroy_process_group() does not help: DDP keeps the C++ group alive,
so gloo's worker threads are never joined. Measured 2026-11-22 on this
script: 6 of 24 runs aborted under torchrun; under `dtrain run`, 3 of 12,
and 4 of 30 with destroy_process_group() at the end of main().
It is torch's teardown, not the launcher, and not what this test is about."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STEPS = 5


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 and os.environ.get("PLAIN_DDP_FAIL_RANK") == str(rank):
        print(f"rank {rank}: injected failure in attempt 0", file=sys.stderr, flush=True)
        sys.exit(1)

    torch.manual_seed(1234 + rank)  # replicas start different: DDP broadcasts rank 0's
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(16, 8, generator=gen)
        y = torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    for r, other in enumerate(gathered):
        if not torch.equal(other, flat):
            raise SystemExit(f"rank {rank}: replica of rank {r} differs")

    out = os.path.join(os.environ["PLAIN_DDP_DIR"], f"result_{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"rank": rank, "world": world, "attempt": attempt, "params": flat.tolist()}, f)
    os.rename(out + ".tmp", out)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skips torch's racy gloo teardown: see the module docstring
