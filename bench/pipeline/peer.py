"""The Python peer of bench/pipeline --mode gpt: the same GPT (bench/gpt/peer.py's
model, examples/gpt's layer list and initialisation), cut into the same stages
(--split: the stage of each layer), trained with torch.distributed.pipelining's
schedule of the same name and micro-batches, SGD, one intra-op thread.

    torchrun --nproc-per-node 2 peer.py --schedule 1f1b --micro-batches 4 --split 0,0,0,1,1,1
    peer.py --schedule none     (one process, the unpipelined model)
    torchrun --nproc-per-node 4 peer.py --schedule 1f1b --dp-shard 2 ...
        (2 pipeline replicas, each stage under FSDP2 fully_shard over its
        dp_shard group with reshard_after_forward=False, as torchtitan does
        under pipelining; each replica trains on its half of the batch)
    torchrun --nproc-per-node 2 peer.py --schedule none --data-parallel lockstep|ddp
        (bench gpt's scaling case, as bench_pipeline's: every rank trains the
        whole model on the same batch, one barrier per step; ddp wraps it in
        torch.nn.parallel.DistributedDataParallel; wall time over the timed
        steps from rank 0, {"impl": "torch", "data_parallel": ..., "world": ...})

Prints {"impl":"torch.distributed.pipelining","step_ms":...} from the last stage's rank.
Differences: the head's output projection is not synchronised with the first
stage's embedding here (dtrain sums the tied gradients, one extra exchange)."""
import argparse
import collections
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpt"))
import peer as gpt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from torch_exit import exit_without_teardown  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--split", default="")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dp-shard", type=int, default=1)
    ap.add_argument("--data-parallel", default="none", choices=["none", "lockstep", "ddp"])
    a = ap.parse_args()
    if a.data_parallel != "none" and a.schedule != "none":
        ap.error("--data-parallel needs --schedule none")
    torch.set_num_threads(1)
    cfg = argparse.Namespace(block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False)
    model = gpt.Gpt(gpt.Config(cfg, 65))
    gpt.init_weights(model, 4, 1337)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(65, (a.batch, 64), generator=gen)
    y = torch.randint(65, (a.batch, 64), generator=gen)
    times = []
    if a.data_parallel != "none":
        dist.init_process_group("gloo")
        net = model
        if a.data_parallel == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(a.warmup + a.steps):
            dist.barrier()
            if step == a.warmup:
                start = time.perf_counter()
            opt.zero_grad()
            gpt.lm_loss(net(x), y).backward()
            opt.step()
        dist.barrier()
        mean = (time.perf_counter() - start) / a.steps * 1000
        world = dist.get_world_size()
        if dist.get_rank() == 0:
            print(json.dumps({"impl": "torch", "schedule": "none", "data_parallel": a.data_parallel, "world": world,
                              "batch": a.batch, "step_ms": round(mean, 2),
                              "tokens_per_second": round(world * a.batch * 64 * 1000 / mean)}), flush=True)
        dist.destroy_process_group()
        return
    if a.schedule == "none":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(a.warmup + a.steps):
            start = time.perf_counter()
            opt.zero_grad()
            gpt.lm_loss(model(x), y).backward()
            opt.step()
            if step >= a.warmup:
                times.append(time.perf_counter() - start)
        last = True
    else:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)
        dist.init_process_group("gloo")
        pp_group, dp_mesh = None, None
        if a.dp_shard > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (dist.get_world_size() // a.dp_shard, a.dp_shard),
                                    mesh_dim_names=("pp", "dp_shard"))
            pp_group, dp_mesh = mesh["pp"].get_group(), mesh["dp_shard"]
            dp = mesh["dp_shard"].get_local_rank()
            x, y = x.chunk(a.dp_shard)[dp], y.chunk(a.dp_shard)[dp]
        rank, p = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        v = 2 if a.schedule == "interleaved" else 1
        n = p * v
        split = [int(s) for s in a.split.split(",")]
        layers = list(model.layers.named_children())
        stages = []
        for s in range(rank, n, p):
            sub = nn.Sequential(collections.OrderedDict([(name, m) for (name, m), k in zip(layers, split) if k == s]))
            if dp_mesh is not None:
                for layer in sub.children():
                    if any(True for _ in layer.parameters()):
                        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
                fully_shard(sub, mesh=dp_mesh, reshard_after_forward=False)
            stages.append(PipelineStage(sub, s, n, torch.device("cpu"), group=pp_group))
        params = [q for st in stages for q in st.submod.parameters()]
        opt = torch.optim.SGD(params, lr=1e-3)
        m = a.micro_batches
        if a.schedule == "gpipe":
            sched = ScheduleGPipe(stages[0], m, loss_fn=gpt.lm_loss)
        elif a.schedule == "1f1b":
            sched = Schedule1F1B(stages[0], m, loss_fn=gpt.lm_loss)
        elif a.schedule == "interleaved":
            sched = ScheduleInterleaved1F1B(stages, m, loss_fn=gpt.lm_loss)
        else:
            sched = ScheduleInterleavedZeroBubble(stages, m, loss_fn=gpt.lm_loss)
        last = rank == (n - 1) % p and (dp_mesh is None or dp_mesh.get_local_rank() == 0)
        for step in range(a.warmup + a.steps):
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            kwargs = {}
            if rank == (n - 1) % p:
                kwargs["target"] = y
                kwargs["losses"] = []
            if rank == 0:
                sched.step(x, **kwargs)
            else:
                sched.step(**kwargs)
            opt.step()
            if step >= a.warmup:
                times.append(time.perf_counter() - start)
        dist.destroy_process_group()
    if last:
        mean = sum(times) / len(times) * 1000
        print(json.dumps({"impl": "torch.distributed.pipelining", "schedule": a.schedule,
                          "micro_batches": a.micro_batches, "batch": a.batch, "dp_shard": a.dp_shard,
                          "step_ms": round(mean, 2),
                          "tokens_per_second": round(a.batch * 64 * 1000 / mean)}), flush=True)


if __name__ == "__main__":
    main()
    exit_without_teardown()
