"""Launch-to-first-step and SIGKILL-to-first-step-after-recovery times of
`dtrain run` and torchrun (same torch version): both starting the same C++
worker (bench/launcher/worker.cpp), so that only the launchers differ, and
torchrun starting the equivalent Python worker (worker.py), what a Python
user of torchrun actually waits for.

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
            # Workers have RANK in their environment; launchers and agents do not.
            if f"RANK={rank}".encode() in env:
                found.append(child)
    return found


def measure(cmd, nproc):
    directory = tempfile.mkdtemp(prefix="dtrain-launcher-bench-")
    env = dict(os.environ, BENCH_DIR=directory)
    start = time.time()
    # Output to a file: with /dev/null for output, torchrun did not restart its
    # Python workers in our runs.
    log = open(os.path.join(directory, "launcher.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        first = wait_files(directory, "step_0", nproc)
        victims = descendants_with_rank(proc.pid, 1)
        if not victims:
            raise RuntimeError("rank 1 worker not found")
        killed = time.time()
        os.kill(victims[0], signal.SIGKILL)
        try:
            recovered = wait_files(directory, "step_1", nproc, timeout=60)
        except TimeoutError:
            log.flush()
            tail = open(os.path.join(directory, "launcher.log")).read()[-600:]
            print(f"# {' '.join(cmd[:4])}...: no recovery within 60 s; output ends: {tail!r}", file=sys.stderr)
            return first - start, None
        proc.wait(timeout=60)
        return first - start, recovered - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtrain", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--python-worker", required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-python-worker", action="store_true")
    args = ap.parse_args()
    common = ["--nproc-per-node", str(args.nproc), "--max-restarts", "1", "--monitor-interval", "0.1"]
    launchers = {
        "dtrain run": [args.dtrain, "run", *common, args.worker],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", *common, "--no-python",
                     args.worker],
        # What a Python user runs: torchrun with a Python worker doing the same work.
        "torchrun + python worker": [sys.executable, "-m", "torch.distributed.run", "--standalone", *common,
                                     args.python_worker],
    }
    if args.skip_python_worker:
        del launchers["torchrun + python worker"]
    results = {}
    for name, cmd in launchers.items():
        starts, recoveries, failed = [], [], 0
        for _ in range(args.reps):
            s, r = measure(cmd, args.nproc)
            starts.append(s)
            if r is None:
                failed += 1
            else:
                recoveries.append(r)
        results[name] = (statistics.median(starts), statistics.median(recoveries) if recoveries else float("nan"))
        print(json.dumps({"impl": name, "start_s": [round(x, 3) for x in starts],
                          "recovery_s": [round(x, 3) for x in recoveries], "failed_recoveries": failed}), flush=True)
    for peer, case in (("torchrun", "same_cpp_worker"), ("torchrun + python worker", "native_workers")):
        if peer not in results:
            continue
        for metric, i in (("start_to_first_step_s", 0), ("kill_to_first_step_after_recovery_s", 1)):
            d, p = results["dtrain run"][i], results[peer][i]
            print(json.dumps({"bench": "launcher", "case": f"{args.nproc}_{case}", "metric": metric,
                              "dtrain": round(d, 4), "peer": round(p, 4), "peer_name": peer,
                              "ratio": round(p / d, 3), "dtrain_over_peer": round(d / p, 3)}))


if __name__ == "__main__":
    main()
