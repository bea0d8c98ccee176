"""One replica group (one rank) of bench/ft under torchft 0.2.0: the same MLP,
data and log lines as bench/ft/worker.cpp --mode ft, through torchft's
Manager (quorum from its Rust lighthouse, live recovery over its HTTP
checkpoint transport) with ProcessGroupGloo on CPU. Per step: start_quorum,
forward and backward, one flat manager.allreduce of the gradients (as
dtrain's FaultTolerantReplicas does), should_commit, optimizer step.

    torchft_worker.py --replica-id 1 --lighthouse http://127.0.0.1:29510 --log-dir D --steps 300
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch.distributed import TCPStore

from torchft import Manager, ProcessGroupGloo


def make_mlp(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(width, 16))
    return torch.nn.Sequential(*layers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--timeout", type=float, default=5.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    # The replica group's own store (torchft expects one, as torchelastic makes).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = make_mlp(a.width, a.depth)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = list(model.parameters())

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=a.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=1, timeout=timeout, rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=store.port, lighthouse_addr=a.lighthouse, replica_id=f"replica_{a.replica_id}")
    log = open(os.path.join(a.log_dir, f"log_{a.replica_id}.txt"), "a", buffering=1)
    healing_logged = False
    while manager.current_step() < a.steps:
        manager.start_quorum()
        optimizer.zero_grad()
        step = manager.current_step()
        gen = torch.Generator().manual_seed(step * 1000 + a.replica_id)
        x = torch.randn(a.batch, a.width, generator=gen)
        y = torch.randint(0, 16, (a.batch,), generator=gen)
        F.cross_entropy(model(x), y).backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        manager.allreduce(flat).wait()
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
        if manager._healing and not healing_logged:
            healing_logged = True
        if not manager.should_commit():
            continue
        optimizer.step()
        now = int(time.time() * 1000)
        if healing_logged:
            log.write(f"recovered {manager.current_step() - 1} pid {os.getpid()} t_ms {now}\n")
            healing_logged = False
        log.write(f"step {manager.current_step() - 1} members {manager.num_participants()} pid {os.getpid()} "
                  f"t_ms {now}\n")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
