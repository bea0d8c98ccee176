"""Records the output dtype of ops under torch.autocast("cpu", torch.bfloat16)
for tests/unit/autocast_test.cpp, which runs the same ops under
dtrain::amp::Autocast and expects the same dtypes.

Run with the pinned torch (scripts/setup.sh's venv):
  ~/.cache/dtrain/venv/bin/python tests/data/amp/gen_autocast.py > tests/data/amp/autocast_dtypes.json

"model" is a small network's forward, layer by layer, and its loss; "ops" are
single ops from autocast's lower-precision, fp32 and promote lists and from
none (which keep their inputs' dtype). The C++ test builds the same inputs by
name: keep the two lists in step.
"""
import json
import sys

import torch
import torch.nn.functional as F


def inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    return {
        "x": r(4, 8), "w1": r(16, 8), "b1": r(16), "w2": r(5, 16), "b2": r(5),
        "img": r(2, 3, 8, 8), "kernel": r(4, 3, 3, 3),
        "a3": r(2, 4, 6), "b3": r(2, 6, 3), "c3": r(2, 4, 3), "m": r(4, 6), "n": r(6, 3), "c": r(4, 3),
        "y": torch.tensor([0, 1, 4, 2]), "target": r(4, 5), "probs": torch.rand(4, 5, generator=g),
        "ids": torch.tensor([[1, 2], [0, 3]]), "table": r(5, 8), "sq": r(6, 6) + 6 * torch.eye(6),
    }


def model(t):
    """Returns (name, tensor) for each stage of a small forward and loss."""
    out = []
    h = F.linear(t["x"], t["w1"], t["b1"]); out.append(("linear1", h))
    h = F.relu(h); out.append(("relu", h))
    h = F.layer_norm(h, [16]); out.append(("layer_norm", h))
    h = F.gelu(h); out.append(("gelu", h))
    logits = F.linear(h, t["w2"], t["b2"]); out.append(("linear2", logits))
    out.append(("log_softmax", F.log_softmax(logits, 1)))
    out.append(("cross_entropy", F.cross_entropy(logits, t["y"])))
    out.append(("mse_loss", F.mse_loss(logits, t["target"])))
    out.append(("residual_add", logits + t["target"]))  # bf16 + fp32: type promotion
    return out


def ops(t):
    return [
        ("mm", torch.mm(t["m"], t["n"])),
        ("matmul", torch.matmul(t["a3"], t["b3"])),
        ("bmm", torch.bmm(t["a3"], t["b3"])),
        ("addmm", torch.addmm(t["c"], t["m"], t["n"])),
        ("baddbmm", torch.baddbmm(t["c3"], t["a3"], t["b3"])),
        ("conv2d", F.conv2d(t["img"], t["kernel"], padding=1)),
        ("max_pool2d", F.max_pool2d(F.conv2d(t["img"], t["kernel"]), 2)),
        ("batch_norm_eval", F.batch_norm(t["img"], torch.zeros(3), torch.ones(3), training=False)),
        ("softmax", torch.softmax(t["x"], 1)),
        ("sum", t["x"].sum()),
        ("exp", torch.exp(t["x"])),
        ("tanh", torch.tanh(t["x"])),
        ("prod", torch.prod(t["x"])),
        ("cdist", torch.cdist(t["m"], t["m"])),
        ("binary_cross_entropy", F.binary_cross_entropy(t["probs"], t["probs"].round())),
        ("nll_loss", F.nll_loss(F.log_softmax(t["target"], 1), t["y"])),
        ("l1_loss", F.l1_loss(t["x"], t["x"] * 2)),
        ("smooth_l1_loss", F.smooth_l1_loss(t["x"], t["x"] * 2)),
        ("kl_div", F.kl_div(t["target"], t["probs"], reduction="batchmean")),
        ("embedding", F.embedding(t["ids"], t["table"])),
        ("inverse", torch.inverse(t["sq"])),
        ("cat_mixed", torch.cat([torch.mm(t["m"], t["n"]), t["c"]])),
        ("stack_mixed", torch.stack([torch.mm(t["m"], t["n"]), t["c"]])),
        ("linear_bf16_plus_fp32", F.linear(t["x"], t["w1"]) + t["b1"]),
        # The same kinds of ops on a bf16 input (the output of mm).
        ("softmax_of_bf16", torch.softmax(torch.mm(t["m"], t["n"]), 1)),
        ("sum_of_bf16", torch.mm(t["m"], t["n"]).sum()),
        ("exp_of_bf16", torch.exp(torch.mm(t["m"], t["n"]))),
        ("prod_of_bf16", torch.prod(torch.mm(t["m"], t["n"]))),
        ("cdist_of_bf16", torch.cdist(torch.mm(t["m"], t["n"]), t["c"])),
        ("l1_loss_of_bf16", F.l1_loss(torch.mm(t["m"], t["n"]), t["c"])),
        ("mse_loss_of_bf16", F.mse_loss(torch.mm(t["m"], t["n"]), t["c"])),
        ("add_bf16_bf16", torch.mm(t["m"], t["n"]) + torch.mm(t["m"], t["n"])),
    ]


def main():
    t = inputs()
    with torch.autocast("cpu", torch.bfloat16):
        recorded = {"model": [[n, str(v.dtype).replace("torch.", "")] for n, v in model(t)],
                    "ops": [[n, str(v.dtype).replace("torch.", "")] for n, v in ops(t)]}
    # Gradients of fp32 leaves stay fp32 when backward runs outside the region.
    w = t["w1"].clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        loss = F.linear(t["x"], w).float().sum()
    loss.backward()
    recorded["leaf_grad"] = str(w.grad.dtype).replace("torch.", "")
    recorded["torch_version"] = torch.__version__
    json.dump(recorded, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
