"""Records torch.optim.lr_scheduler's learning rates for
tests/trainer/lr_schedule_test.cpp, which runs dtrain's LinearLR,
CosineAnnealingLR and WarmupCosineLR over the same optimizers.

Run with the pinned torch (scripts/setup.sh's venv):
  ~/.cache/dtrain/venv/bin/python tests/data/lr_schedules/gen_lr_schedules.py > tests/data/lr_schedules/lr_schedules.json

Each case: an SGD optimizer with two parameter groups (lr 0.5 and 0.05), a
scheduler, and the groups' learning rates after construction ("lrs"[0]) and
after each of `steps` scheduler.step() calls ("lrs"[k]). "warmup_cosine" is
SequentialLR(LinearLR -> CosineAnnealingLR) at the warm-up's end.
"""
import json
import warnings

import torch
from torch.optim import lr_scheduler as S

BASE = [0.5, 0.05]


def optimizer():
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in BASE], lr=BASE[0])


def record(make, steps):
    opt = optimizer()
    sched = make(opt)
    lrs = [[g["lr"] for g in opt.param_groups]]
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


def main():
    warnings.simplefilter("ignore")
    cases = []
    for start, end, total, steps in [(0.1, 1.0, 5, 9), (1.0 / 3, 1.0, 4, 7), (1.0, 0.2, 6, 9)]:
        cases.append({"kind": "linear", "start_factor": start, "end_factor": end, "total_steps": total,
                      "lrs": record(lambda o: S.LinearLR(o, start, end, total), steps)})
    for t_max, eta_min, steps in [(10, 0.0, 12), (8, 0.01, 25)]:
        cases.append({"kind": "cosine", "t_max": t_max, "eta_min": eta_min,
                      "lrs": record(lambda o: S.CosineAnnealingLR(o, t_max, eta_min), steps)})
    for warmup, total, start, eta_min, steps in [(4, 14, 0.1, 0.001, 16), (1, 6, 0.5, 0.0, 6)]:
        def make(o):
            return S.SequentialLR(o, [S.LinearLR(o, start, 1.0, warmup),
                                      S.CosineAnnealingLR(o, total - warmup, eta_min)], milestones=[warmup])
        cases.append({"kind": "warmup_cosine", "warmup_steps": warmup, "total_steps": total,
                      "start_factor": start, "eta_min": eta_min, "lrs": record(make, steps)})
    print(json.dumps({"torch": torch.__version__, "base_lrs": BASE, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
