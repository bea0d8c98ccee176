"""The Python peer of examples/gpt: the same GPT (nanoGPT's model, with the
same parameter names and layer list as examples/gpt/model.h), the same
initialisation (GPT-2's, drawn from a generator seeded --seed, in
named_parameters order), the same batches (examples/gpt/corpus.h, Note [GPT
batches]) and hyperparameters, trained as nanoGPT's train.py does on a CPU:
torch.optim.AdamW with fused=False (its single-tensor loop), clip_grad_norm_,
warm-up + cosine learning rate.

    peer.py [--max-iters 2000 ...]            one process
    peer.py --compile ...                     one process, the model under
                                              torch.compile (nanoGPT's default)
    torchrun --nproc-per-node 2 peer.py ...   DDP over gloo
    peer.py --export FILE [model options]     writes initial weights, one batch,
                                              its logits, loss and gradients
                                              (torch.save) for tests/unit/gpt_test.cpp

Prints JSON lines like the C++ example: eval lines, then
{"event":"done","val_loss":...,"tokens_per_second":...,"step_ms":{...}}.
Under --compile, tokens_per_second is the steady state's (the steps after
the warm-up ones), compile_seconds what the first training step and the first
evaluation took beyond a steady one (torch.compile's tracing and code
generation), and tokens_per_second_with_compile the whole run's."""
import argparse
import collections
import contextlib
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from torch_exit import exit_without_teardown  # noqa: E402


class Config:
    def __init__(self, args, vocab_size):
        self.vocab_size = vocab_size
        self.block_size = args.block_size
        self.n_layer = args.n_layer
        self.n_head = args.n_head
        self.n_embd = args.n_embd
        self.dropout = args.dropout
        self.bias = args.bias


class LayerNorm(nn.Module):
    def __init__(self, n, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Embed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, idx):
        return self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.resid_drop = nn.Dropout(c.dropout)

    def forward(self, x):
        b, t, c = x.shape
        h = self.c.n_head
        q, k, v = (m.view(b, t, h, c // h).transpose(1, 2) for m in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.c.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = LayerNorm(c.n_embd, c.bias)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = LayerNorm(c.n_embd, c.bias)
        self.mlp = Mlp(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final LayerNorm and logits = x @ wte^T; the embedding is referenced, not registered."""

    def __init__(self, c, embed):
        super().__init__()
        self.ln_f = LayerNorm(c.n_embd, c.bias)
        self.__dict__["embed"] = embed

    def forward(self, x):
        return F.linear(self.ln_f(x), self.embed.wte.weight)


class Gpt(nn.Module):
    def __init__(self, c):
        super().__init__()
        embed = Embed(c)
        layers = [("embed", embed)] + [(f"block{i}", Block(c)) for i in range(c.n_layer)] + [("head", Head(c, embed))]
        self.layers = nn.Sequential(collections.OrderedDict(layers))

    def forward(self, idx):
        return self.layers(idx)


def init_weights(model, n_layer, seed):
    """GPT-2's initialisation, as examples/gpt/model.h's init_weights draws it."""
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln_" in name:
                p.fill_(1.0)
            else:
                std = residual_std if "c_proj.weight" in name else 0.02
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# --- data: examples/gpt/corpus.h ---

def train_batch_seed(seed, step):
    return (seed << 24) + step


def val_batch_seed(seed, k):
    return (seed << 24) + (1 << 23) + k


def default_data_dir():
    cache = os.environ.get("DTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dtrain")
    return os.path.join(cache, "shakespeare_char")


class Split:
    def __init__(self, path, block_size):
        self.tokens = torch.from_numpy(np.fromfile(path, dtype="<u2").astype(np.int64))
        self.block_size = block_size
        self.windows = len(self.tokens) - block_size  # TokenFileDataset's windows at stride 1

    def draw(self, count, seed):
        return torch.randint(self.windows, (count,), generator=torch.Generator().manual_seed(seed))

    def batch(self, offsets):
        x = torch.stack([self.tokens[i:i + self.block_size] for i in offsets.tolist()])
        y = torch.stack([self.tokens[i + 1:i + 1 + self.block_size] for i in offsets.tolist()])
        return x, y


def learning_rate(args, it):
    decay_iters = args.lr_decay_iters or args.max_iters
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    if it > decay_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / (decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def export_reference(args, vocab_size, train):
    """Initial weights, the first training batch, and the model's logits, loss
    and gradients on it, for the C++ model to reproduce."""
    model = Gpt(Config(args, vocab_size))
    init_weights(model, args.n_layer, args.seed)
    offsets = train.draw(args.batch_size, train_batch_seed(args.seed, 0))
    x, y = train.batch(offsets)
    logits = model(x)
    loss = lm_loss(logits, y)
    loss.backward()
    out = {"offsets": offsets, "x": x, "y": y, "logits": logits.detach(), "loss": loss.detach()}
    for name, p in model.named_parameters():
        out["param/" + name] = p.detach().clone()
        out["grad/" + name] = p.grad.clone()
    torch.save(out, args.export)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-iters", type=int, default=2000)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--eval-iters", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup-iters", type=int, default=100)
    ap.add_argument("--lr-decay-iters", type=int, default=0)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta2", type=float, default=0.99)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--data-dir", default=default_data_dir())
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (one process only)")
    ap.add_argument("--export", help="write the reference for tests to this file and exit")
    args = ap.parse_args()

    with open(os.path.join(args.data_dir, "meta.json")) as f:
        meta = json.load(f)
    train = Split(os.path.join(args.data_dir, "train.bin"), args.block_size)
    val = Split(os.path.join(args.data_dir, "val.bin"), args.block_size)
    if args.export:
        export_reference(args, meta["vocab_size"], train)
        return

    distributed = "RANK" in os.environ
    rank, world = 0, 1
    if distributed:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)  # dropout masks
    model = Gpt(Config(args, meta["vocab_size"]))
    init_weights(model, args.n_layer, args.seed)
    if args.compile:
        if distributed:
            sys.exit("peer.py: --compile runs in one process only")
        model = torch.compile(model)  # as nanoGPT's train.py: the model, not the optimizer
    trained = nn.parallel.DistributedDataParallel(model) if distributed else model
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2), eps=1e-8, fused=False)

    def evaluate():
        model.eval()
        total = 0.0
        with torch.no_grad():
            for k in range(rank, args.eval_iters, world):
                x, y = val.batch(val.draw(args.batch_size * world, val_batch_seed(args.seed, k)))
                total += lm_loss(model(x), y).item()
        model.train()
        if distributed:
            t = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(t)
            total = t.item()
        return total / args.eval_iters

    per_micro = args.batch_size * world
    global_batch = per_micro * args.accumulate
    skip = min(10, args.max_iters // 10)
    times = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    measured = 0
    train_seconds, loss_sum, loss_count, val_loss = 0.0, 0.0, 0, float("nan")

    eval_seconds, step_seconds = [], []

    def report(step):
        nonlocal val_loss, loss_sum, loss_count
        t = time.perf_counter()
        val_loss = evaluate()
        eval_seconds.append(time.perf_counter() - t)
        if rank == 0:
            print(json.dumps({"event": "eval", "step": step,
                              "train_loss": loss_sum / loss_count if loss_count else float("nan"),
                              "val_loss": val_loss}), flush=True)
        loss_sum, loss_count = 0.0, 0

    for step in range(args.max_iters):
        if step % args.eval_interval == 0:
            report(step)
        start = time.perf_counter()
        lr = learning_rate(args, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = train.draw(global_batch, train_batch_seed(args.seed, step))
        fwd = bwd = step_loss = 0.0
        for micro in range(args.accumulate):
            first = micro * per_micro + rank * args.batch_size
            x, y = train.batch(offsets[first:first + args.batch_size])
            sync = micro + 1 == args.accumulate or not distributed
            with contextlib.nullcontext() if sync else trained.no_sync():
                t = time.perf_counter()
                loss = lm_loss(trained(x), y) / args.accumulate
                fwd += time.perf_counter() - t
                t = time.perf_counter()
                loss.backward()
                bwd += time.perf_counter() - t
            step_loss += loss.item()
        t = time.perf_counter()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        opt_s = time.perf_counter() - t
        step_seconds.append(time.perf_counter() - start)
        train_seconds += step_seconds[-1]
        if step >= skip:
            times["forward"] += fwd * 1e3
            times["backward"] += bwd * 1e3
            times["optimizer"] += opt_s * 1e3
            measured += 1
        loss_sum += step_loss
        loss_count += 1
    report(args.max_iters)
    if distributed:
        dist.barrier()
    if rank == 0:
        n = max(measured, 1)
        tokens_per_second = global_batch * args.block_size * args.max_iters / train_seconds
        steady = step_seconds[skip:] or step_seconds
        steady_step = sum(steady) / len(steady)
        done = {"event": "done", "impl": "torch" + (" DDP" if distributed else ""), "world_size": world,
                "steps": args.max_iters, "val_loss": val_loss, "tokens_per_second": tokens_per_second,
                "train_seconds": train_seconds, "steady_step_ms": steady_step * 1e3,
                "step_ms": {k: v / n for k, v in times.items()}}
        if args.compile:
            later_eval = eval_seconds[-1] if len(eval_seconds) > 1 else 0.0
            done.update(impl="torch.compile", tokens_per_second=global_batch * args.block_size / steady_step,
                        tokens_per_second_with_compile=tokens_per_second,
                        compile_seconds=step_seconds[0] - steady_step + eval_seconds[0] - later_eval)
        print(json.dumps(done), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
