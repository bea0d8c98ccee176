"""The short run of bench/gpt (issue 29): its JSON says what it measured.

Runs bench/gpt/run.sh on 20 steps of the single-process case (no
torch.compile peer: it compiles for ~25 s) and checks, against /proc and
against the lines' own figures:
- every comparison line carries the machine: the CPU model /proc/cpuinfo
  names and the cores this process may use;
- both ratios: "ratio" (dtrain's kernels) and "ratio_like_for_like" (dtrain
  with DTRAIN_LINEAR_KERNEL=aten), each equal to its quotient of the line's
  own dtrain, dtrain_aten and peer figures;
- the like-for-like run really ran on ATen's kernels (its done line says
  linear_kernel "aten") and the default one on what nn::linear picks here;
- an MFU line per run, against a measured peak, between 0 and 1;
- the scaling case (one round): a single-process, a 2-rank lockstep and a
  2-rank DDP run on each side (dtrain, torch), and a summary whose ceiling,
  efficiency and ddp_over_lockstep (dtrain's, and the peer's) are the
  quotients of those runs' tokens/s.

    bench_json_test.py --source SRC --build BUILD --python VENV_PYTHON
"""
import argparse
import json
import os
import subprocess
import sys


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return "unknown CPU"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--python", required=True)
    args = ap.parse_args()
    env = dict(os.environ, DTRAIN_BUILD=args.build, DTRAIN_PYTHON=args.python, DTRAIN_BENCH_STEPS="20",
               DTRAIN_BENCH_CASES="single scaling", DTRAIN_BENCH_COMPILE="0",
               DTRAIN_BENCH_ROUNDS="1")
    env.pop("DTRAIN_LINEAR_KERNEL", None)
    run = subprocess.run([os.path.join(args.source, "bench", "gpt", "run.sh")], env=env, capture_output=True,
                         text=True, timeout=540)
    print(run.stdout)
    if run.returncode != 0:
        print(run.stderr)
        fail(f"bench/gpt/run.sh exited {run.returncode}")
    lines = [json.loads(l) for l in run.stdout.splitlines() if l.startswith("{")]

    dones = [l for l in lines if l.get("event") == "done"]
    kernels = sorted(l.get("linear_kernel", "?") for l in dones if l["impl"] == "dtrain")
    if len(kernels) != 2 or "aten" not in kernels:
        fail(f"expected a dtrain run on each kernel choice, one on 'aten'; got {kernels}")

    comparisons = [l for l in lines if l.get("bench") == "gpt" and "ratio" in l]
    tokens = [l for l in comparisons if l["metric"] == "tokens_per_second"]
    if len(tokens) != 1:
        fail(f"expected one tokens_per_second comparison (single), got {len(tokens)}")
    cores = len(os.sched_getaffinity(0))
    for l in comparisons:
        m = l.get("machine") or fail(f"no machine in {l}")
        if m["cpu"] != cpu_model() or m["cores"] != cores:
            fail(f"machine {m} is not /proc's ({cpu_model()}, {cores} cores)")
        if l["ratio_like_for_like"] is None or l["dtrain_aten"] is None:
            fail(f"no like-for-like ratio in {l}")
        higher = l["metric"] == "tokens_per_second"
        for ours, ratio in ((l["dtrain"], l["ratio"]), (l["dtrain_aten"], l["ratio_like_for_like"])):
            expected = ours / l["peer"] if higher else l["peer"] / ours
            if abs(expected - ratio) > 1e-3 * max(1.0, expected):
                fail(f"{l['metric']}: ratio {ratio} is not the quotient {expected:.4f} of the line's figures")

    mfu = [l for l in lines if l.get("metric") == "mfu"]
    if sorted(l["impl"] for l in mfu) != ["dtrain", "dtrain aten", "torch"]:
        fail(f"expected an MFU line for dtrain, dtrain aten and torch; got {[l['impl'] for l in mfu]}")
    for l in mfu:
        if not 0 < l["mfu"] < 1 or l["peak_gflops"] <= 0 or l["machine"]["cpu"] != cpu_model():
            fail(f"implausible MFU line {l}")

    summary = [l for l in lines if l.get("case") == "scaling"]
    if len(summary) != 1 or summary[0]["rounds"] != 1 or summary[0]["machine"]["cpu"] != cpu_model():
        fail(f"expected one scaling summary of one round on this CPU; got {summary}")
    for side, figures in (("dtrain", summary[0]), ("torch", summary[0].get("peer") or {})):
        runs = {l.get("data_parallel", "none"): l for l in lines if l.get("schedule") == "none" and "step_ms" in l
                and (l["impl"] == "dtrain") == (side == "dtrain")}
        if sorted(runs) != ["ddp", "lockstep", "none"]:
            fail(f"expected one {side} single, lockstep and ddp scaling run; got {sorted(runs)}")
        if runs["lockstep"]["world"] != 2 or runs["ddp"]["world"] != 2:
            fail(f"the {side} scaling runs are not on 2 ranks: {runs}")
        single, lock, ddp = (runs[k]["tokens_per_second"] for k in ("none", "lockstep", "ddp"))
        for key, expected in (("ceiling", lock / (2 * single)), ("efficiency", ddp / (2 * single)),
                              ("ddp_over_lockstep", ddp / lock)):
            if abs(figures.get(key, -1) - expected) > 1e-3 * max(1.0, expected):
                fail(f"{side} scaling {key} {figures.get(key)} is not the quotient {expected:.4f} of its runs")
    print("bench gpt JSON: machine, both ratios, MFU and the scaling decomposition present and consistent")


if __name__ == "__main__":
    main()
