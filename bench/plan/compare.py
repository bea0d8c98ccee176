#!/usr/bin/env python3
"""The planner's predictions against measured runs of examples/gpt on this host.

For each plan (single, DDP, ZeRO 1-3, HSDP 2x2, pipelines with each schedule,
tp 2 with and without sequence parallelism, cp 2) on 1-4 processes:
  - predicted: `dtrain plan --device-file F --fixed <the whole plan> --json`
    (peak memory per rank, step seconds);
  - measured: `dtrain run --nproc-per-node N gpt <the plan's flags>` with
    DTRAIN_GPT_RUN_STATS=1 (examples/gpt/run_stats.h): each rank's peak CPU
    tensor storage (dtrain::CpuMemoryStats) and its median wall and CPU time
    per optimizer step; a run's figures are the worst rank's; the step time
    is the median over --runs runs. The CPU column is compared with the model
    without the links' call_latency (a wait for a peer is wall time, not CPU).
Every rank runs one thread (OMP_NUM_THREADS=1): the calibration measures one
core per rank, and the planner divides the host's cores among more ranks.
Prints a Markdown table (with the 1-minute load average beside each run's
time) and writes one JSON line per plan to --out. Rerun on a quiet machine
for time figures that mean something; memory does not depend on the load.

  bench/plan/compare.py [--build build] [--runs 3] [--steps 12] [--plans ddp2,zero3_2]
                        [--device-file F]   # default: calibrate into build/plan-cpu-here.json
  bench/plan/compare.py --memory-only --steps 3 --check-memory 0.10   # the suite's test (every plan)
  bench/plan/compare.py --calibrate --plans single,ddp2,tp2,cp2 --check-time 0.30 --check-relative 0.15 --attempts 3
                                                                         # the suite's time test
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

GLOBAL_BATCH = 24
MODEL = dict(layers=4, hidden=128, heads=4, seq=64)  # examples/gpt's defaults

# name: (world, gpt flags, planner --fixed)
PLANS = {
    "single": (1, "--dp-replicate 1", "dp_replicate=1,dp_shard=1,zero=0"),
    "ddp2": (2, "--dp-replicate 2", "dp_replicate=2,dp_shard=1,zero=0"),
    "zero1_2": (2, "--dp-shard 2 --zero-stage 1", "dp_replicate=1,dp_shard=2,zero=1"),
    "zero2_2": (2, "--dp-shard 2 --zero-stage 2", "dp_replicate=1,dp_shard=2,zero=2"),
    "zero3_2": (2, "--dp-shard 2 --zero-stage 3", "dp_replicate=1,dp_shard=2,zero=3"),
    "pp2_gpipe": (2, "--pp 2 --pp-schedule gpipe --micro-batches 4", "pp=2,schedule=gpipe,micro_batch=6"),
    "pp2_1f1b": (2, "--pp 2 --pp-schedule 1f1b --micro-batches 4", "pp=2,schedule=1f1b,micro_batch=6"),
    "pp2_interleaved": (2, "--pp 2 --pp-schedule interleaved --micro-batches 4",
                        "pp=2,schedule=interleaved,stages_per_rank=2,micro_batch=6"),
    "pp2_zb": (2, "--pp 2 --pp-schedule zb --micro-batches 4", "pp=2,schedule=zb,micro_batch=6"),
    "tp2": (2, "--tp 2", "tp=2,sequence_parallel=false"),
    "tp2_sp": (2, "--tp 2 --sequence-parallel", "tp=2,sequence_parallel=true"),
    "cp2": (2, "--cp 2", "cp=2"),
    "ddp4": (4, "--dp-replicate 4", "dp_replicate=4,dp_shard=1,zero=0"),
    "zero3_4": (4, "--dp-shard 4 --zero-stage 3", "dp_replicate=1,dp_shard=4,zero=3"),
    "hsdp2x2": (4, "--dp-replicate 2 --dp-shard 2 --zero-stage 3", "dp_replicate=2,dp_shard=2,zero=3"),
}


def fixed_of(name, world):
    _, _, fixed = PLANS[name]
    keys = dict(kv.split("=") for kv in fixed.split(","))
    keys.setdefault("tp", "1")
    keys.setdefault("pp", "1")
    keys.setdefault("cp", "1")
    keys.setdefault("recompute", "none")
    if int(keys["pp"]) > 1 or int(keys["tp"]) > 1 or int(keys["cp"]) > 1:
        keys.setdefault("dp_replicate", "1")
        keys.setdefault("dp_shard", "1")
        keys.setdefault("zero", "0")
    if "micro_batch" not in keys:
        dp = int(keys["dp_replicate"]) * int(keys["dp_shard"])
        keys["micro_batch"] = str(GLOBAL_BATCH // dp)
    return ",".join(f"{k}={v}" for k, v in keys.items())


def attention_of(name, linear_kernel):
    """The attention examples/gpt ran: dtrain::nn::causal_attention materialises the scores where its oneDNN
    path runs (the run reported linear_kernel "onednn"; seq <= 256); --tp and --cp keep their flash kernels."""
    onednn = linear_kernel == "onednn" and MODEL["seq"] <= 256 and not name.startswith(("tp", "cp"))
    return "materialized" if onednn else "flash"


def busy_device_file(path):
    """The device file without the links' call_latency: a collective's wait for
    a peer the scheduler has not run yet is wall time but no CPU time, so the
    CPU-time comparison (the loaded host's measure) is against this model."""
    with open(path) as f:
        device = json.load(f)
    for value in device.values():
        if isinstance(value, dict) and "call_latency" in value:
            value["call_latency"] = 0.0
    busy = path + ".busy.json"
    with open(busy, "w") as f:
        json.dump(device, f)
    return busy


def predict(args, name, vocab, attention, device_file=None):
    world = PLANS[name][0]
    device_file = device_file or args.device_file
    spec = "gpt:" + ",".join(f"{k}={v}" for k, v in MODEL.items()) + \
        f",vocab={vocab},attention={attention},kernels=eager,dropout=0,bias=0"
    cmd = [os.path.join(args.build, "tools", "dtrain"), "plan", "--model", spec, *(["--device-file", device_file] if device_file else ["--device", "cpu-here"]),
           "--gpus", str(world), "--global-batch", str(GLOBAL_BATCH), "--precision", "fp32", "--weights",
           "fp32-master", "--ddp-bucket-copy", "--fixed", fixed_of(name, world), "--json", "--top", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"dtrain plan failed for {name}: {out.stderr}\n{' '.join(cmd)}")
    return json.loads(out.stdout.splitlines()[0])


def measure(args, name):
    world, flags, _ = PLANS[name]
    env = dict(os.environ, OMP_NUM_THREADS="1", DTRAIN_GPT_RUN_STATS="1", DTRAIN_LOG_LEVEL="warning")
    cmd = [os.path.join(args.build, "tools", "dtrain"), "run", "--standalone", "--nproc-per-node", str(world),
           os.path.join(args.build, "examples", "gpt"), *flags.split(), "--global-batch-size", str(GLOBAL_BATCH),
           "--max-iters", str(args.steps), "--warmup-iters", "2", "--eval-interval", "100000", "--eval-iters", "1",
           "--sample-tokens", "0", "--no-memory-check"]
    load = os.getloadavg()[0]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    load = max(load, os.getloadavg()[0])
    stats = []
    for line in out.stdout.splitlines():
        brace = line.find("{")
        if brace >= 0 and '"rank_stats"' in line:
            stats.append(json.loads(line[brace:]))
    if out.returncode != 0 or len(stats) != world:
        raise SystemExit(f"run of {name} failed (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return {"linear_kernel": "onednn" if '"linear_kernel":"onednn"' in out.stdout else "aten",
            "peak_bytes": max(s["peak_bytes"] for s in stats),
            "wall_ms": max(s["step_wall_ms"] for s in stats),
            "cpu_ms": max(s["step_cpu_ms"] for s in stats),
            "load": load}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--device-file", default="")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--plans", default=",".join(PLANS))
    p.add_argument("--vocab", type=int, default=0, help="the corpus's characters (default: its meta.json's)")
    p.add_argument("--memory-only", action="store_true", help="one run per plan; no time columns")
    p.add_argument("--check-memory", type=float, default=0,
                   help="exit 1 unless every predicted peak is within this fraction of the measured")
    p.add_argument("--check-time", type=float, default=0,
                   help="exit 1 unless every predicted step is within this fraction of the measured one (the CPU "
                        "column: the busiest rank's CPU time per step, which other work on a shared host inflates "
                        "much less than the wall time, against the model without the links' call_latency, the "
                        "waits for peers that are wall time but no CPU time)")
    p.add_argument("--check-relative", type=float, default=0,
                   help="exit 1 unless every plan's predicted step over the one-process plan's predicted step is "
                        "within this fraction of the same quotient measured (the CPU columns; needs 'single' among "
                        "--plans): the model's account of what a plan adds to one process, free of the host's "
                        "absolute speed, which on a shared VM moves between the calibration and the runs")
    p.add_argument("--calibrate", action="store_true", help="calibrate into the device file even if it exists")
    p.add_argument("--calibrate-ranks", default="",
                   help="with --calibrate: dtrain plan's --calibrate-ranks (default its own, 2 and 4); 2 is enough "
                        "for plans of 1-2 ranks on 2 cores")
    p.add_argument("--attempts", type=int, default=1,
                   help="with --check-time or --check-relative: calibrate (with --calibrate) and measure again, "
                        "up to this many times in all, while a step time is out of bounds (a shared VM's speed can move between the "
                        "calibration and the runs: the same calibration's cache rate spread 25-35 GB/s here)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.check_relative > 0 and "single" not in args.plans.split(","):
        raise SystemExit("--check-relative needs the plan 'single' among --plans (the reference quotient)")
    rc = run_once(args)
    for attempt in range(2, args.attempts + 1):
        if rc == 0 or (args.check_time <= 0 and args.check_relative <= 0):
            break
        print(f"\nattempt {attempt} of {args.attempts}: calibrating and measuring again", file=sys.stderr, flush=True)
        print(f"\n## attempt {attempt}\n", flush=True)
        rc = run_once(args)
    return rc


def run_once(args):
    if not args.memory_only:  # memory does not depend on the rates
        args.device_file = args.device_file or os.path.join(args.build, "plan-cpu-here.json")
        if args.calibrate or not os.path.exists(args.device_file):
            subprocess.run([os.path.join(args.build, "tools", "dtrain"), "plan", "--calibrate", "--device-file",
                            args.device_file, *(["--calibrate-ranks", args.calibrate_ranks] if args.calibrate_ranks else [])],
                           check=True, stdout=subprocess.DEVNULL)
    if args.vocab == 0:
        cache = os.environ.get("DTRAIN_CACHE", os.path.expanduser("~/.cache/dtrain"))
        with open(os.path.join(cache, "shakespeare_char", "meta.json")) as f:
            args.vocab = json.load(f)["vocab_size"]
    runs = 1 if args.memory_only else args.runs
    rows = []
    print("| plan | ranks | peak MiB pred / meas | error | step ms pred / meas (wall) | error | CPU ms/step (x ranks/core) "
          "| error vs CPU | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    cores = os.cpu_count() or 1
    busy_file = busy_device_file(args.device_file) if args.device_file and not args.memory_only else None
    names = args.plans.split(",")
    # Runs interleaved (every plan once, then again): a shared host's speed
    # moves over minutes (one program's step 56-87 ms within an hour on the
    # Intel VM of 2026-11-28), and plans measured one after the other would
    # each sample another state of it; interleaved, each plan's median is
    # taken over the same stretch of time.
    measured = {name: [] for name in names}
    for _ in range(runs):
        for name in names:
            measured[name].append(measure(args, name))
    for name in names:
        meas = measured[name]
        attention = attention_of(name, meas[0]["linear_kernel"])
        pred = predict(args, name, args.vocab, attention)
        pred_busy = predict(args, name, args.vocab, attention, busy_file) if busy_file else pred
        peak_meas = max(m["peak_bytes"] for m in meas)
        peak_pred = max(pred["peak_memory_bytes"])
        wall = statistics.median(m["wall_ms"] for m in meas)
        cpu = statistics.median(m["cpu_ms"] for m in meas)
        load = max(m["load"] for m in meas)
        row = {"plan": name, "ranks": PLANS[name][0], "peak_pred": peak_pred, "peak_meas": peak_meas,
               "memory_error": peak_pred / peak_meas - 1, "step_pred_ms": 1e3 * pred["step_seconds"],
               "step_wall_ms": wall, "step_cpu_ms": cpu, "time_error": 1e3 * pred["step_seconds"] / wall - 1,
               "load": load, "runs": runs, "prediction": pred}
        # A quiet host's wall time per step: the busiest rank's CPU time, times
        # the ranks sharing each core when there are more ranks than cores.
        cpu_wall = cpu * max(1.0, row["ranks"] / cores)
        row["step_cpu_wall_ms"] = cpu_wall
        row["step_pred_busy_ms"] = 1e3 * pred_busy["step_seconds"]
        row["time_error_cpu"] = row["step_pred_busy_ms"] / cpu_wall - 1
        rows.append(row)
        print(f"| {name} | {row['ranks']} | {peak_pred / 2**20:.1f} / {peak_meas / 2**20:.1f} | "
              f"{100 * row['memory_error']:+.1f} % | {row['step_pred_ms']:.0f} / {wall:.0f} | "
              f"{100 * row['time_error']:+.1f} % | {cpu_wall:.0f} | {100 * row['time_error_cpu']:+.1f} % | {load:.1f} |",
              flush=True)
    if not args.memory_only:
        for world in sorted({r["ranks"] for r in rows}):
            group = [r for r in rows if r["ranks"] == world]
            if len(group) < 2:
                continue
            best_pred = min(group, key=lambda r: r["step_pred_ms"])
            for key in ("step_wall_ms", "step_cpu_wall_ms"):
                best_meas = min(group, key=lambda r: r[key])
                print(f"\n{world} ranks, by {key}: predicted best {best_pred['plan']} (measured {best_pred[key]:.0f} ms), "
                      f"measured best {best_meas['plan']} ({best_meas[key]:.0f} ms): "
                      f"{100 * (best_pred[key] / best_meas[key] - 1):+.1f} %")
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if args.check_memory > 0:
        bad = [r for r in rows if abs(r["memory_error"]) > args.check_memory]
        for r in bad:
            print(f"memory of {r['plan']}: predicted {r['peak_pred']:.0f} B, measured {r['peak_meas']:.0f} B "
                  f"({100 * r['memory_error']:+.1f} %, bound {100 * args.check_memory:.0f} %)", file=sys.stderr)
        return 1 if bad else 0
    failed = False
    if args.check_time > 0:
        bad = [r for r in rows if abs(r["time_error_cpu"]) > args.check_time]
        for r in bad:
            print(f"step time of {r['plan']}: predicted {r['step_pred_busy_ms']:.1f} ms without waits for peers, "
                  f"measured {r['step_cpu_wall_ms']:.1f} "
                  f"ms of CPU ({100 * r['time_error_cpu']:+.1f} %, bound {100 * args.check_time:.0f} %)", file=sys.stderr)
        failed = failed or bool(bad)
    if args.check_relative > 0:
        one = next(r for r in rows if r["plan"] == "single")
        for r in rows:
            if r is one:
                continue
            predicted = r["step_pred_busy_ms"] / one["step_pred_busy_ms"]
            measured = r["step_cpu_wall_ms"] / one["step_cpu_wall_ms"]
            error = predicted / measured - 1
            print(f"{r['plan']} over single: predicted {predicted:.3f}, measured {measured:.3f} ({100 * error:+.1f} %)")
            if abs(error) > args.check_relative:
                print(f"step time of {r['plan']} relative to one process: predicted {predicted:.3f}, measured "
                      f"{measured:.3f} ({100 * error:+.1f} %, bound {100 * args.check_relative:.0f} %)", file=sys.stderr)
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
