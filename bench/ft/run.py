"""bench/ft: surviving the SIGKILL of one of 4 replica groups (issue 27).

Same model, data and machine for every case; one rank per replica group.
--model gpt (the default, the issue's workload): examples/gpt as shipped
(bench gpt's model: 4 layers, width 128, context 64, 12 sequences per rank
and step, AdamW, clipping), and for torchft the same GPT in Python
(bench/gpt/peer.py's model, initialisation and batches). --model mlp: the
MLP of bench/ft/worker.cpp (a step of a few ms: fault tolerance's fixed
costs per step at their largest).
  ft        dtrain run --ft-replicas 4: fault-tolerant replica groups
            (Trainer with TrainerOptions::fault_tolerance); the launcher
            restarts the killed group, which recovers live from a peer;
  restart   dtrain run --max-restarts: 4-rank DDP with a checkpoint every
            --checkpoint-every steps; the launcher restarts every rank, which
            resume from the last checkpoint;
  torchft   torchft 0.2.0: its Rust lighthouse, Manager and ProcessGroupGloo
            (bench/ft/torchft_worker.py); this script restarts the killed
            replica group, as a launcher would.
Replica group 1 is SIGKILLed once it has committed --kill-at steps.

Figures per case: fault to the first full-quorum step (the first step the
restarted group commits with all 4 groups taking part), steps trained again
(committed before the fault and once more after it: lost work), steps that
ran with fewer than 4 groups (their batch shrank), the steady step time, and
(ft) the recovery step on group 0, the restarted group's source.
Steady state also runs ft and plain DDP (fault tolerance off) without a
fault, --steady-rounds times, alternating (the median of each is reported).
The last lines are JSON: one per case, then the ratios
({"bench","case","metric","dtrain","peer","peer_name","ratio","machine"},
ratio > 1: dtrain better).
"""
import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from machine import machine  # noqa: E402

LINE = re.compile(r"(step|recovered) (\d+)(?: members (\d+))? pid (\d+) t_ms (\d+(?:\.\d+)?)")


def read_log(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                m = LINE.match(line) if line.endswith("\n") else None  # else still being written
                if m:
                    kind, step, members, pid, t = m.groups()
                    out.append({"kind": kind, "step": int(step), "members": int(members or 0), "pid": int(pid),
                                "t_ms": float(t)})
    except FileNotFoundError:
        pass
    return out


def read_sample_log(path, world):
    """examples/gpt's Trainer sample log (TrainerOptions::sample_log): one
    JSON line per committed step, with the pid of the incarnation that
    trained it and, under fault tolerance, the step's members."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                # A line without its newline is still being written (the
                # case's end is polled while its ranks train).
                if not line.startswith("{") or not line.endswith("\n"):
                    continue
                j = json.loads(line)  # "step": steps done, so the committed step's index + 1
                out.append({"kind": "step", "step": j["step"] - 1, "members": len(j.get("members", [])) or world,
                             "pid": j["pid"], "t_ms": j["t_ns"] / 1e6})
    except FileNotFoundError:
        pass
    return out


def steps_of(path):
    if path.endswith(".jsonl"):
        return read_sample_log(path, STATE["world"])
    return [e for e in read_log(path) if e["kind"] == "step"]


# The replicas (or DDP ranks) of the run: sample logs name a rank's steps.
STATE = {"world": 4}


def log_of(log_dir, args, r, name):
    """Where replica group (or DDP rank) r logs its committed steps."""
    if args.model == "gpt" and name != "torchft":
        return os.path.join(log_dir, f"samples.rank{r}.jsonl")
    return os.path.join(log_dir, f"log_{r}.txt")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout, what, procs=None):
    """Polls `predicate` until it holds; TimeoutError after `timeout` s, and at
    once (RuntimeError) when every process of `procs` (a dict) has exited
    without it holding: a case whose workers could not start fails in
    seconds, not after its timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if procs and all(p.poll() is not None for p in procs.values()):
            if predicate():
                return
            codes = ", ".join(str(p.returncode) for p in procs.values())
            raise RuntimeError(f"{what}: its processes exited (codes {codes}) first")
        time.sleep(0.01)
    raise TimeoutError(what)


def steady_ms(steps, skip=20):
    """Median interval between consecutive committed steps of one process."""
    intervals = [b["t_ms"] - a["t_ms"] for a, b in zip(steps, steps[1:])
                 if a["pid"] == b["pid"] and b["step"] == a["step"] + 1 and a["step"] >= skip]
    return round(statistics.median(intervals), 2) if intervals else float("nan")


def analyse(paths, replicas, victim, victim_pid, t_kill_ms, full):
    logs = {r: steps_of(paths[r]) for r in range(replicas)}
    after = [e for e in logs[victim] if e["pid"] != victim_pid and e["members"] == full]
    heal = (after[0]["t_ms"] - t_kill_ms) / 1000 if after else float("nan")
    # Steps trained twice: committed by the first incarnation (before the
    # fault) and again after it, on any replica.
    again = 0
    for r in range(replicas):
        before = {e["step"] for e in logs[r] if e["t_ms"] <= t_kill_ms}
        later = {e["step"] for e in logs[r] if e["t_ms"] > t_kill_ms}
        again = max(again, len(before & later))
    survivor = logs[0]
    shrunk = len({e["step"] for e in survivor if e["members"] < full})
    # The recovery step on group 0 (the restarted group's source: the first
    # up-to-date member): from its previous commit to its commit of the first
    # full-quorum step after the fault, which includes serving the state.
    recovery_step = float("nan")
    if after:
        healed = after[0]["step"]
        mine = {e["step"]: e["t_ms"] for e in survivor}
        if healed in mine and healed - 1 in mine:
            recovery_step = mine[healed] - mine[healed - 1]
    return {"fault_to_full_quorum_s": round(heal, 3), "steps_trained_again": again, "steps_below_full": shrunk,
            "steady_step_ms": steady_ms([e for e in survivor if e["t_ms"] <= t_kill_ms] or survivor),
            "source_recovery_step_ms": recovery_step}


GPT = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64"]


def worker_command(name, args, log_dir):
    """The program one rank (or replica group) runs, and its arguments."""
    ckpt = name == "restart"
    if args.model == "mlp":
        cmd = [args.worker, "--mode", "ft" if name.startswith("ft") else "ddp", "--log-dir", log_dir, "--steps",
               str(args.steps), "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
        if ckpt:
            cmd += ["--checkpoint-dir", os.path.join(log_dir, "ckpt"), "--checkpoint-every",
                    str(args.checkpoint_every)]
        return cmd
    # examples/gpt as a user runs it: one replica group of one process
    # (--strategy single) under --ft-replicas, DDP over every rank otherwise;
    # evaluations (and checkpoints) every --checkpoint-every steps only where
    # checkpoints are written, a one-batch evaluation at the start and end.
    strategy = "single" if name.startswith("ft") else "ddp"
    cmd = [args.gpt, "--strategy", strategy, *GPT, "--batch-size", str(args.gpt_batch), "--max-iters",
           str(args.steps), "--eval-iters", "1", "--sample-tokens", "0", "--devices", "cpu", "--sample-log",
           os.path.join(log_dir, "samples.jsonl"), "--eval-interval",
           str(args.checkpoint_every if ckpt else 10 * args.steps)]
    if ckpt:
        cmd += ["--checkpoint-dir", os.path.join(log_dir, "ckpt")]
    return cmd


def run_case(name, args, kill=True):
    log_dir = tempfile.mkdtemp(prefix=f"bench-ft-{name}-")
    procs = {}
    lighthouse = None
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.malloc_threshold_mb > 0:
        # glibc serves blocks above its mmap threshold (128 KiB at first,
        # raised only when such a block is freed) from fresh pages: whether a
        # rank's per-step temporaries of ~1 MB (the optimizer's, the
        # activations) fault in every step then depends on what the process
        # happened to free earlier (0 to ~1,400 minor faults per step seen
        # here, for the same binary). Every case gets the same setting.
        threshold = str(args.malloc_threshold_mb << 20)
        env.update(MALLOC_MMAP_THRESHOLD_=threshold, MALLOC_TRIM_THRESHOLD_=str(2 * (args.malloc_threshold_mb << 20)))
    hb_s = args.heartbeat_timeout
    launcher_log = ["--log-dir", os.path.join(log_dir, "launcher")]
    if name in ("ft", "ft_nofault"):
        cmd = [args.dtrain, "run", "--nproc-per-node", str(args.replicas), "--ft-replicas", str(args.replicas),
               "--max-restarts", "3", "--ft-heartbeat-timeout", str(hb_s), "--ft-join-timeout",
               str(args.join_timeout), *launcher_log, *worker_command(name, args, log_dir)]
        procs["launcher"] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif name in ("restart", "ddp_nofault"):
        cmd = [args.dtrain, "run", "--nproc-per-node", str(args.replicas), "--max-restarts", "3", *launcher_log,
               *worker_command(name, args, log_dir)]
        procs["launcher"] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:  # torchft
        port = free_port()
        lighthouse = subprocess.Popen(
            [args.torchft_lighthouse, "--min_replicas", "1", "--bind", f"[::]:{port}", "--heartbeat_timeout_ms",
             str(int(hb_s * 1000)), "--join_timeout_ms", str(int(args.join_timeout * 1000)), "--quorum_tick_ms", "10"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        model = ["--model", "gpt", "--batch", str(args.gpt_batch)] if args.model == "gpt" else [
            "--model", "mlp", "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]

        def start(r):
            return subprocess.Popen(
                [args.python, args.torchft_worker, "--replica-id", str(r), "--lighthouse", f"http://127.0.0.1:{port}",
                 "--log-dir", log_dir, "--steps", str(args.steps), *model], env=env, stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(log_dir, f"err_{r}"), "a"))
        for r in range(args.replicas):
            procs[r] = start(r)
    paths = [log_of(log_dir, args, r, name) for r in range(args.replicas)]
    victim = 1
    result = {"case": name}
    try:
        if kill:
            wait_until(lambda: len(steps_of(paths[victim])) >= args.kill_at, 300, f"{name}: no step {args.kill_at}",
                       procs)
            victim_pid = steps_of(paths[victim])[-1]["pid"]
            t_kill_ms = int(time.time() * 1000)
            os.kill(victim_pid, signal.SIGKILL)
            if name == "torchft":
                procs[victim].wait()
                procs[victim] = start(victim)
        # The end: every replica's log reaches the last step.
        last = args.steps - 1

        def done():
            return all(any(e["step"] == last for e in steps_of(path)) for path in paths)
        wait_until(done, args.case_timeout, f"{name}: did not finish within {args.case_timeout} s", procs)
        if kill:
            result.update(analyse(paths, args.replicas, victim, victim_pid, t_kill_ms, args.replicas))
        else:
            result["steady_step_ms"] = steady_ms(steps_of(paths[0]))
    finally:
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if lighthouse:
            lighthouse.kill()
            lighthouse.wait()
    result["log_dir"] = log_dir
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtrain", required=True)
    p.add_argument("--worker", required=True, help="bench_ft_worker (--model mlp)")
    p.add_argument("--gpt", required=True, help="examples/gpt (--model gpt)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--torchft-worker", required=True)
    p.add_argument("--torchft-lighthouse", required=True)
    p.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    # Midway between two checkpoints (--checkpoint-every 20): restart-from-checkpoint loses its average.
    p.add_argument("--kill-at", type=int, default=70)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gpt-batch", type=int, default=12, help="sequences per replica group and step (gpt)")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    p.add_argument("--join-timeout", type=float, default=10.0)
    p.add_argument("--case-timeout", type=float, default=400.0)
    p.add_argument("--cases", default="ft,restart,torchft,ft_nofault,ddp_nofault")
    p.add_argument("--steady-rounds", type=int, default=1,
                   help="runs of each steady-state case (ft_nofault, ddp_nofault), alternating; medians reported")
    p.add_argument("--malloc-threshold-mb", type=int, default=0,
                   help="glibc's mmap and trim thresholds for every process (0: glibc's defaults)")
    a = p.parse_args()
    STATE["world"] = a.replicas
    if a.model == "gpt":
        print(f"# GPT (examples/gpt; torchft: bench/gpt/peer.py's): 4 layers, 4 heads, width 128, context 64, "
              f"{a.gpt_batch} sequences per replica group and step; ", end="")
    else:
        params = a.depth * (a.width * a.width + a.width) + a.width * 16 + 16
        print(f"# MLP {a.depth} x {a.width} (+16 outputs), {params / 1e6:.2f} M parameters, batch {a.batch}; ", end="")
    print(f"{a.replicas} replica groups of one rank; SIGKILL of group 1 after {a.kill_at} steps, {a.steps} steps; "
          f"heartbeat timeout {a.heartbeat_timeout} s, join timeout {a.join_timeout} s; checkpoints every "
          f"{a.checkpoint_every} steps")
    results = {}
    cases = a.cases.split(",")
    steady = [c for c in cases if c.endswith("_nofault")]
    order = [c for c in cases if not c.endswith("_nofault")] + steady * max(1, a.steady_rounds)
    for case in order:
        try:
            r = run_case(case, a, kill=not case.endswith("_nofault"))
        except Exception as e:  # a case that fails is reported, the others still run
            r = {"case": case, "error": str(e)}
        print(json.dumps({"bench": "ft", "model": a.model, **r}), flush=True)
        results.setdefault(case, []).append(r)
    one = {c: rs[-1] for c, rs in results.items()}
    ft, rs, tf = one.get("ft", {}), one.get("restart", {}), one.get("torchft", {})
    where = machine()
    metric = "fault_to_full_quorum_s"
    for peer_name, peer in (("torchft-0.2.0", tf), ("dtrain-restart-from-checkpoint", rs)):
        if metric in ft and metric in peer:
            print(json.dumps({"bench": "ft", "case": f"{a.model}_{a.replicas}_replicas_sigkill", "metric": metric,
                              "dtrain": ft[metric], "peer": peer[metric], "peer_name": peer_name,
                              "ratio": round(peer[metric] / ft[metric], 3), "machine": where}))

    def steady_of(case):
        ms = [r["steady_step_ms"] for r in results.get(case, []) if "steady_step_ms" in r]
        return statistics.median(ms) if ms else None
    on, off = steady_of("ft_nofault"), steady_of("ddp_nofault")
    if on and off:
        print(json.dumps({"bench": "ft", "case": f"{a.model}_{a.replicas}_replicas_steady", "metric": "steps_per_s",
                          "dtrain": round(1000 / on, 2), "peer": round(1000 / off, 2), "peer_name": "dtrain-ddp-ft-off",
                          "ratio": round(off / on, 3), "rounds": len(results["ft_nofault"]), "machine": where}))


if __name__ == "__main__":
    main()
