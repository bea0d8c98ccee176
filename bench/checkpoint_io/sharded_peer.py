"""PyTorch FSDP2 + DCP on the workload of sharded_bench.cpp: 4 CPU ranks over
Gloo, `layers` Linear(width, width), one AdamW step, then dcp.save and
dcp.load (with get_state_dict / set_state_dict) of model and optimizer,
timed on rank 0 between barriers."""
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

WORLD = 4


def run(rank, folder, layers, width):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/peer_pg", rank=rank, world_size=WORLD)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    path = os.path.join(folder, "peer_dcp")
    dist.barrier()
    t = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    dist.barrier()
    save_s = time.perf_counter() - t
    t = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    dist.barrier()
    load_s = time.perf_counter() - t
    if rank == 0:
        gb = layers * (width * width + width) * 4 * 3 / 1e9
        for case, s in (("sharded_save_4_ranks", save_s), ("sharded_load_4_ranks", load_s)):
            print(json.dumps({"impl": "fsdp2+dcp", "case": case, "seconds": round(s, 4),
                              "gb_per_s": round(gb / s, 3)}), flush=True)
        shutil.rmtree(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    if os.path.exists(f"{folder}/peer_pg"):
        os.remove(f"{folder}/peer_pg")
    mp.spawn(run, args=(folder, layers, width), nprocs=WORLD)
