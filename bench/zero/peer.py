"""The Python peer of bench/zero: the same GPT (bench/gpt/peer.py's model,
examples/gpt's shapes), the same random batch per rank and AdamW, one step
timed the same way, under torch DDP, FSDP2 (fully_shard on every block, then
the root, as its docs show for transformers) or ZeroRedundancyOptimizer over
DDP (ZeRO-1). CPU, gloo, one OpenMP thread per rank.

    torchrun --nproc-per-node 2 peer.py --strategy ddp|fsdp2|zero_redundancy

Rank 0 prints {"impl":"torch_<strategy>","case":..,"p50_ms":..,"p95_ms":..}."""
import argparse
import importlib.util
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from torch_exit import exit_without_teardown  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "gpt_peer", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpt", "peer.py"))
gpt_peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt_peer)


class Args:
    pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", required=True, choices=["ddp", "fsdp2", "zero_redundancy"])
    ap.add_argument("--replicas", type=int, default=1, help="fsdp2 only: HSDP over a 2-D mesh")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--case", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    a = Args()
    a.block_size, a.n_layer, a.n_head, a.n_embd, a.dropout, a.bias = args.block, args.n_layer, 4, args.n_embd, 0.0, False
    model = gpt_peer.Gpt(gpt_peer.Config(a, 65))
    gpt_peer.init_weights(model, args.n_layer, 1337)
    if args.strategy == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    elif args.strategy == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3,
                                      weight_decay=0.1, foreach=False)
    else:
        from torch.distributed.fsdp import fully_shard
        mesh = None
        if args.replicas > 1:  # HSDP: shard within dp_shard, all-reduce across dp_replicate
            from torch.distributed.device_mesh import init_device_mesh
            world = dist.get_world_size()
            mesh = init_device_mesh("cpu", (args.replicas, world // args.replicas),
                                    mesh_dim_names=("dp_replicate", "dp_shard"))
        for name, layer in model.layers.named_children():
            if name.startswith("block"):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, 65, (args.batch, args.block), generator=gen)
    y = torch.randint(0, 65, (args.batch, args.block), generator=gen)
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        loss = gpt_peer.lm_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    dist.barrier()
    if rank == 0:
        times.sort()
        impl = "torch_" + args.strategy
        if args.replicas > 1:
            impl = f"torch_hsdp{args.replicas}x{dist.get_world_size() // args.replicas}"
        print(json.dumps({"impl": impl, "case": args.case or args.strategy,
                          "p50_ms": round(times[int(0.5 * (len(times) - 1))], 3),
                          "p95_ms": round(times[int(0.95 * (len(times) - 1))], 3)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
