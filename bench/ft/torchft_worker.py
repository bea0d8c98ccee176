"""One replica group (one rank) of bench/ft under torchft 0.2.0, through
torchft's Manager (quorum from its Rust lighthouse, live recovery over its
HTTP checkpoint transport) with ProcessGroupGloo on CPU. Per step:
start_quorum, forward and backward, one flat manager.allreduce of the
gradients (as dtrain's FaultTolerantReplicas does), should_commit, optimizer
step. Log lines "step S members M pid P t_ms T" as bench/ft/worker.cpp's.
  --model gpt   examples/gpt's GPT as bench/gpt/peer.py has it (same
                initialisation, batches of the Shakespeare token files,
                AdamW, clipping at 1.0, warm-up and cosine learning rate);
                replica group r trains its slice r of the step's global batch;
  --model mlp   bench/ft/worker.cpp's MLP, data and Adam.

    torchft_worker.py --replica-id 1 --lighthouse http://127.0.0.1:29510 --log-dir D --steps 300
"""
import argparse
import os
import sys
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


class GptWork:
    """bench/gpt/peer.py's GPT with examples/gpt's defaults (AdamW, weight
    decay on matrices, clipping, warm-up then cosine decay over the run)."""

    def __init__(self, a):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpt"))
        import json
        import peer
        args = argparse.Namespace(block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False, seed=1337,
                                  lr=1e-3, min_lr=1e-4, warmup_iters=100, lr_decay_iters=0, max_iters=a.steps)
        data_dir = peer.default_data_dir()
        with open(os.path.join(data_dir, "meta.json")) as f:
            vocab = json.load(f)["vocab_size"]
        self.peer, self.args, self.batch, self.replicas = peer, args, a.batch, a.replicas
        self.train = peer.Split(os.path.join(data_dir, "train.bin"), args.block_size)
        self.model = peer.Gpt(peer.Config(args, vocab))
        peer.init_weights(self.model, args.n_layer, args.seed)
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99), eps=1e-8, fused=False)

    def loss(self, step, replica):
        offsets = self.train.draw(self.batch * self.replicas, self.peer.train_batch_seed(self.args.seed, step))
        x, y = self.train.batch(offsets[replica * self.batch:(replica + 1) * self.batch])
        return self.peer.lm_loss(self.model(x), y)

    def step(self, step):
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = self.peer.learning_rate(self.args, step)
        self.optimizer.step()


class MlpWork:
    def __init__(self, a):
        self.model = make_mlp(a.width, a.depth)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.a = a

    def loss(self, step, replica):
        gen = torch.Generator().manual_seed(step * 1000 + replica)
        x = torch.randn(self.a.batch, self.a.width, generator=gen)
        y = torch.randint(0, 16, (self.a.batch,), generator=gen)
        return F.cross_entropy(self.model(x), y)

    def step(self, step):
        self.optimizer.step()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--model", choices=["gpt", "mlp"], default="mlp")
    p.add_argument("--replicas", type=int, default=4, help="replica groups (gpt: the global batch's slices)")
    p.add_argument("--timeout", type=float, default=5.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    # The replica group's own store (torchft expects one, as torchelastic makes).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    work = GptWork(a) if a.model == "gpt" else MlpWork(a)
    model, optimizer = work.model, work.optimizer
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
        work.loss(step, a.replica_id).backward()
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
        work.step(step)
        now = int(time.time() * 1000)
        if healing_logged:
            log.write(f"recovered {manager.current_step() - 1} pid {os.getpid()} t_ms {now}\n")
            healing_logged = False
        log.write(f"step {manager.current_step() - 1} members {manager.num_participants()} pid {os.getpid()} "
                  f"t_ms {now}\n")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
