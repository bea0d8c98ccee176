"""Launch-to-first-step and SIGKILL-to-first-step-after-recovery times of
`dtrain run` and torchrun (same torch version), both starting the same C++
worker (bench/launcher/worker.cpp) so that only the launchers differ.

Start: from spawning the launcher to the moment every rank has finished its
first step. Recovery: from SIGKILLing rank 1 to every rank of the restarted
group finishing its first step. Median over --reps runs; both launchers use a
0.1 s monitor interval and one restart."""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def wait_files(directory, prefix, n, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        paths = [os.path.join(directory, f"{prefix}_{r}") for r in range(n)]
        if all(os.path.exists(p) for p in paths):
            return max(int(open(p).read()) for p in paths) / 1e9
        time.sleep(0.002)
    raise TimeoutError(f"{prefix} files did not appear in {directory}")


def children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def descendants_with_rank(root, rank):
    """Worker processes (any depth below root) whose environment has RANK=rank."""
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        for child in children(pid):
            stack.append(child)
            try:
                with open(f"/proc/{child}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and b"BENCH_DIR=" + b"" in b"".join(env) and os.path.basename(
                    os.readlink(f"/proc/{child}/exe")).startswith("bench_launcher"):
                found.append(child)
    return found


def measure(cmd, nproc):
    directory = tempfile.mkdtemp(prefix="dtrain-launcher-bench-")
    env = dict(os.environ, BENCH_DIR=directory)
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first = wait_files(directory, "step_0", nproc)
        victims = descendants_with_rank(proc.pid, 1)
        if not victims:
            raise RuntimeError("rank 1 worker not found")
        killed = time.time()
        os.kill(victims[0], signal.SIGKILL)
        recovered = wait_files(directory, "step_1", nproc)
        proc.wait(timeout=60)
        return first - start, recovered - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtrain", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    common = ["--nproc-per-node", str(args.nproc), "--max-restarts", "1", "--monitor-interval", "0.1"]
    launchers = {
        "dtrain run": [args.dtrain, "run", *common, args.worker],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", *common, "--no-python",
                     args.worker],
    }
    results = {}
    for name, cmd in launchers.items():
        starts, recoveries = [], []
        for _ in range(args.reps):
            s, r = measure(cmd, args.nproc)
            starts.append(s)
            recoveries.append(r)
        results[name] = (statistics.median(starts), statistics.median(recoveries))
        print(json.dumps({"impl": name, "start_s": [round(x, 3) for x in starts],
                          "recovery_s": [round(x, 3) for x in recoveries]}), flush=True)
    for metric, i in (("start_to_first_step_s", 0), ("kill_to_first_step_after_recovery_s", 1)):
        d, p = results["dtrain run"][i], results["torchrun"][i]
        print(json.dumps({"bench": "launcher", "case": f"{args.nproc}_workers", "metric": metric, "dtrain": round(d, 4),
                          "peer": round(p, 4), "peer_name": "torchrun", "ratio": round(p / d, 3),
                          "dtrain_over_peer": round(d / p, 3)}))


if __name__ == "__main__":
    main()
