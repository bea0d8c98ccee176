"""The Python peer of bench/tp: PyTorch's DTensor tensor parallelism
(torch.distributed.tensor.parallel.parallelize_module with ColwiseParallel,
RowwiseParallel and, with --sequence-parallel, SequenceParallel) on
bench/gpt/peer.py's GPT, CPU, gloo, one process per rank (env contract),
the same weights (GPT-2 init, seed 1337), batches (torch.randint, generator
seeded 100 + step) and optimizer settings as tp_bench.cpp. Rank 0 prints
{"impl":"torch_dtensor","case":"tp2[_sp]","p50_ms":..,"tokens_per_s":..,"first_loss":..,"last_loss":..}.

The plan is torchtitan's for a Llama block: per block c_attn and c_fc
Colwise, both c_proj Rowwise (with SP: the LayerNorms SequenceParallel,
the attention and the MLP gathering their input, c_proj reduce-scattering
to Shard(1)). Before splitting, the fused QKV weight's rows are permuted so
that Colwise's chunk r is [q_r; k_r; v_r], rank r's heads, as dtrain's
partitioned column layer holds them: both sides compute the same function
(the losses printed agree). The tied embedding and head stay replicated
here (DTensor cannot shard one parameter for two modules); with a
vocabulary of 65 they are ~1% of a step's work, while dtrain splits them
over the vocabulary."""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "gpt"))
sys.path.insert(0, os.path.join(here, "..", "common"))
from peer import Gpt, init_weights  # noqa: E402
from torch_exit import exit_without_teardown  # noqa: E402


def tp_attention_forward(self, x):
    """CausalSelfAttention.forward on this rank's heads (Colwise's local output)."""
    b, t, _ = x.shape
    qkv = self.c_attn(x)
    local = qkv.size(-1) // 3
    h = self.local_heads
    q, k, v = (m.view(b, t, h, local // h).transpose(1, 2) for m in qkv.split(local, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, local))


def group_qkv_rows_by_rank(weight, n_embd, tp):
    """[q; k; v] rows -> [q_0; k_0; v_0; q_1; ...], so Colwise's chunk r is rank r's heads."""
    q, k, v = weight.split(n_embd, 0)
    parts = [torch.cat([m.chunk(tp, 0)[r] for m in (q, k, v)]) for r in range(tp)]
    return torch.cat(parts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--sequence-parallel", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))

    class C:
        pass
    c = C()
    c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd, c.dropout, c.bias = \
        65, a.block, a.n_layer, a.n_head, a.n_embd, 0.0, False
    model = Gpt(c)
    init_weights(model, c.n_layer, 1337)
    sp = a.sequence_parallel
    for i in range(c.n_layer):
        block = model.layers[1 + i]
        with torch.no_grad():
            w = block.attn.c_attn.weight
            w.copy_(group_qkv_rows_by_rank(w, c.n_embd, tp))
        block.attn.local_heads = c.n_head // tp
        block.attn.forward = tp_attention_forward.__get__(block.attn)
        plan = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if sp:
            plan.update({
                "ln_1": SequenceParallel(),
                "ln_2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, mesh, plan)
    if sp:
        # The replicated embedding's output enters the sequence-parallel
        # region as this rank's part; the replicated head gathers it back.
        parallelize_module(model.layers, mesh, {
            "embed": PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                                         use_local_output=True),
            "head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True),
        })
    # Fused AdamW, as dtrain's FusedAdamW: one kernel per group, and a group
    # may not mix DTensor and plain parameters.
    split = [p for p in model.parameters() if hasattr(p, "placements")]
    plain = [p for p in model.parameters() if not hasattr(p, "placements")]
    opt = torch.optim.AdamW([{"params": split}, {"params": plain}], lr=1e-3, weight_decay=0.0, fused=True)

    def batch_of(step):
        g = torch.Generator().manual_seed(100 + step)
        xy = torch.randint(0, c.vocab_size, (2, a.batch, a.block), generator=g)
        return xy[0], xy[1]

    times, first, last = [], 0.0, 0.0
    for i in range(a.warmup + a.steps):
        x, y = batch_of(i)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(x)
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        if i >= a.warmup:
            times.append((time.perf_counter() - start) * 1000)
        if i == 0:
            first = loss.item()
        last = loss.item()
    dist.barrier()
    if dist.get_rank() == 0:
        times.sort()
        p50 = times[(len(times) - 1) // 2]
        print(json.dumps({"impl": "torch_dtensor", "case": f"tp{tp}" + ("_sp" if sp else ""), "p50_ms": round(p50, 3),
                          "tokens_per_s": round(a.batch * a.block / (p50 / 1000), 1), "first_loss": round(first, 6),
                          "last_loss": round(last, 6), "fused_adamw": opt.defaults.get("fused") is True}), flush=True)
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
