"""Records torch.amp.GradScaler's decisions for tests/unit/grad_scaler_test.cpp.

Run with the pinned torch (scripts/setup.sh's venv):
  ~/.cache/dtrain/venv/bin/python tests/data/amp/gen_grad_scaler.py > tests/data/amp/grad_scaler.json

Each scenario builds SGD optimizers over small parameters and, at every step,
sets the gradients a backward of the scaled loss would leave (a fixed
unscaled gradient times the current scale), with inf/NaN planted at chosen
steps. It records what the scaler did: the scale before the step, whether
each optimizer stepped, the gradients after unscaling, the parameters after
the step, the scale, growth tracker and state_dict after update(). Every
float is a float32 value written exactly; non-finite ones as "inf", "-inf",
"nan" (JSON has no literal for them).
"""
import json
import math
import sys

import torch
from torch.amp import GradScaler


def enc(x):
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def flat(t):
    return [enc(v) for v in t.detach().double().reshape(-1).tolist()]


# Per optimizer: a list of param groups, each a list of parameter shapes, and its lr.
LAYOUTS = {
    "one_optimizer_two_groups": [{"groups": [[[3], [2, 2]], [[4]]], "lrs": [0.5, 0.25], "dtype": "float32"}],
    "two_optimizers": [
        {"groups": [[[3]]], "lrs": [0.5], "dtype": "float32"},
        {"groups": [[[2, 3]]], "lrs": [0.125], "dtype": "float32"},
    ],
    "mixed_dtypes": [{"groups": [[[3]], [[5]]], "lrs": [0.5, 0.5], "dtype": "float32,float64"}],
}

# A scenario: a layout, scaler options, and per step the planted non-finite
# values: (optimizer, param, element, value), plus optional actions.
SCENARIOS = [
    {
        "name": "defaults",
        "layout": "one_optimizer_two_groups",
        "options": {},
        "steps": [{}, {"plant": [[0, 1, 2, "inf"]]}, {}, {"plant": [[0, 2, 0, "nan"]]}, {}],
    },
    {
        "name": "growth_and_backoff",
        "layout": "one_optimizer_two_groups",
        "options": {"init_scale": 1024.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 3},
        "steps": [
            {}, {}, {},                                   # grows after 3 clean steps
            {"plant": [[0, 0, 1, "inf"]]},               # backs off, tracker reset
            {}, {"explicit_unscale": True}, {},           # grows again
            {"plant": [[0, 0, 0, "nan"], [0, 2, 3, "-inf"]]},
            {"plant": [[0, 1, 0, "inf"]], "explicit_unscale": True},
            {}, {}, {"new_scale": 3.0},                   # user-set scale replaces the update
            {}, {}, {},
        ],
    },
    {
        "name": "two_optimizers_one_overflows",
        "layout": "two_optimizers",
        "options": {"init_scale": 256.0, "growth_interval": 2},
        "steps": [{}, {"plant": [[1, 0, 4, "inf"]]}, {}, {}, {"plant": [[0, 0, 0, "nan"]]}, {}],
    },
    {
        "name": "mixed_dtypes",
        "layout": "mixed_dtypes",
        "options": {"init_scale": 8.0, "growth_interval": 1},
        "steps": [{}, {"plant": [[0, 1, 2, "inf"]]}, {}, {"explicit_unscale": True}],
    },
]


def base_grad(step, opt, param, numel):
    # Simple values with a few significant bits, so products stay readable.
    return [((step * 7 + opt * 5 + param * 3 + i) % 11 - 5) * 0.375 for i in range(numel)]


def run(scenario):
    layout = LAYOUTS[scenario["layout"]]
    torch.manual_seed(0)
    optimizers, params_per_opt, layout_out = [], [], []
    for o, spec in enumerate(layout):
        dtypes = spec["dtype"].split(",")
        groups, params, groups_out = [], [], []
        for g, shapes in enumerate(spec["groups"]):
            dtype = getattr(torch, dtypes[min(g, len(dtypes) - 1)])
            ps = [torch.nn.Parameter((torch.randn(s) * 4).round() / 4) for s in shapes]
            ps = [torch.nn.Parameter(p.detach().to(dtype)) for p in ps]
            groups.append({"params": ps, "lr": spec["lrs"][g]})
            params += ps
            groups_out.append({"lr": spec["lrs"][g], "dtype": str(dtype).replace("torch.", ""),
                               "shapes": shapes, "init": [flat(p) for p in ps]})
        optimizers.append(torch.optim.SGD(groups))
        params_per_opt.append(params)
        layout_out.append({"groups": groups_out})
    scaler = GradScaler("cpu", **scenario["options"])
    steps_out = []
    for t, step in enumerate(scenario["steps"]):
        loss = torch.tensor(1.5)
        scaled_loss = scaler.scale(loss)
        scale_before = scaler.get_scale()
        grads_in = []
        for o, params in enumerate(params_per_opt):
            per_param = []
            for k, p in enumerate(params):
                g = torch.tensor(base_grad(t, o, k, p.numel()), dtype=torch.float32).reshape(p.shape)
                g = (g * scale_before).to(p.dtype)
                for po, pk, idx, value in step.get("plant", []):
                    if po == o and pk == k:
                        g.view(-1)[idx] = float(value)
                p.grad = g.clone()
                per_param.append(flat(g))
            grads_in.append(per_param)
        if step.get("explicit_unscale"):
            for opt in optimizers:
                scaler.unscale_(opt)
        unscaled = None
        stepped = []
        for o, opt in enumerate(optimizers):
            before = [p.detach().clone() for p in params_per_opt[o]]
            scaler.step(opt)  # unscales first unless unscale_() was called; .grad keeps the unscaled values
            unscaled = unscaled or []
            unscaled.append([flat(p.grad) for p in params_per_opt[o]])
            stepped.append(any(not torch.equal(b, p.detach()) for b, p in zip(before, params_per_opt[o])))
        new_scale = step.get("new_scale")
        scaler.update(new_scale)
        steps_out.append({
            "grads": grads_in,
            "explicit_unscale": bool(step.get("explicit_unscale")),
            "new_scale": new_scale,
            "scaled_loss": scaled_loss.item(),
            "scale_before": scale_before,
            "stepped": stepped,
            "unscaled": unscaled,
            "params_after": [[flat(p) for p in ps] for ps in params_per_opt],
            "scale_after": scaler.get_scale(),
            "growth_tracker_after": scaler._get_growth_tracker(),
            "state_dict": scaler.state_dict(),
        })
    return {"name": scenario["name"], "options": scenario["options"], "optimizers": layout_out, "steps": steps_out}


def main():
    out = {"torch_version": torch.__version__, "scenarios": [run(s) for s in SCENARIOS]}
    json.dump(out, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
