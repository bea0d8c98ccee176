"""Chaos soak, fault-tolerant mode (issue 27; `chaos.py --ft`): one `dtrain run
--ft-replicas G` trains examples/gpt as G replica groups of K ranks (ZeRO-2
inside each) while this driver injects faults at random times drawn from a
fixed seed:

  worker_kill           SIGKILL of one rank of one group (the launcher restarts that group only)
  worker_stop           SIGSTOP of one rank for --stop-seconds, then SIGCONT (a hung member: dropped
                        after the heartbeat timeout, it rejoins behind and recovers)
  two_replicas_kill     one rank of each of two groups SIGKILLed at once
  kill_during_recovery  a group killed, then another one while the first restarts and recovers
  node_kill             (--nodes N > 1) SIGKILL of a whole node other than node 0: its launcher and,
                        with it, its workers; the node's launcher is started again --node-down
                        seconds later, and its groups rejoin and recover live

With --nodes N the job is N launchers on loopback (`dtrain run --nnodes N
--node-rank I --ft-replicas G`, G/N groups each), node 0 hosting the
lighthouse at the rendezvous endpoint (docs/fault_tolerance.md, "Several
nodes"). Not injected: a kill of node 0 (the store host): the lighthouse is
the job's single point, every group then fails and the job fails (restart
it from its checkpoints); a link cut needs network namespaces (root) and
behaves as a node kill for the groups behind it (their heartbeats stop);
a full disk needs checkpoints, which the fault-tolerant job does not need
(recovery is live).

Faults come one at a time: the next waits until the groups the last one hit
commit steps of the full quorum again (the overlapping kinds overlap within
themselves; overlapping more, every group could be lost at once, and with it
the training state: the job then restarts as a whole from its checkpoints,
docs/fault_tolerance.md, which this mode counts as a failure). None is
injected in the last 40% of the steps: a group restarted after its peers
finished is told so and ends without training (docs/fault_tolerance.md,
Quorum), so it would not reach the last step this audit asks of every group.

At the end it checks, from the Trainer's sample logs (one per rank): the job
finished (exit 0, every group at the last step), it never restarted as a
whole (only group restarts in the launcher's log), every step was committed
(none skipped), the groups that logged a step agree on its members and are
among them, each line's samples are its data rank's for that step, and no
sample was trained on twice. It prints one JSON line
{"bench": "chaos_ft", ...} with the faults injected and survived per kind
and the time from each fault to the next step of the full quorum.
"""
import argparse
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

KINDS = ["worker_kill", "worker_stop", "two_replicas_kill", "kill_during_recovery", "node_kill"]
OVERLAP = {"two_replicas_kill", "kill_during_recovery"}
BATCH = 2


def add_arguments(p):
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="ranks per replica group")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--ft-kinds", default=",".join(k for k in KINDS if k != "node_kill"))
    p.add_argument("--nodes", type=int, default=1, help="launchers on loopback, node 0 hosting the lighthouse")
    p.add_argument("--node-down", type=float, default=1.5, help="seconds a killed node stays down")
    p.add_argument("--stop-seconds", type=float, default=2.0)
    p.add_argument("--heartbeat-timeout", type=float, default=0.5)


def lines_of(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line being written
    except FileNotFoundError:
        pass
    return out


class FtSoak:
    def __init__(self, a):
        self.a = a
        self.dir = tempfile.mkdtemp(prefix="dtrain-chaos-ft-")
        self.rng = random.Random(a.seed)
        self.world = a.replicas * a.ranks
        self.faults = []  # (kind, time, groups)

    def log(self, f):
        return os.path.join(self.dir, f"samples.rank{f}.jsonl")

    def last(self, f):
        ls = lines_of(self.log(f))
        return ls[-1] if ls else None

    def all_in_quorum(self):
        """Whether every rank has committed a step of the full quorum: on a loaded
        machine a node's groups may join seconds after the others have started
        stepping, and a fault before then would hit nothing (a node kill with no
        hits, counted as not survived)."""
        return all((l := self.last(f)) is not None and len(l["members"]) == self.a.replicas
                   for f in range(self.world))

    def newest_step(self):
        return max((l["step"] for l in (self.last(f) for f in range(self.world)) if l), default=0)

    def signal(self, group, sig):
        """Signals one rank of `group`; returns (its log file, its pid), or None."""
        f = group * self.a.ranks + self.rng.randrange(self.a.ranks)
        l = self.last(f)
        if l is None:
            return None
        try:
            os.kill(l["pid"], sig)
            return (f, l["pid"])
        except ProcessLookupError:
            return None

    def recovered(self, fault):
        _, _, hits, since, new_process = fault
        return all(self.back_after(h, since, new_process) is not None for h in hits)

    def back_after(self, hit, since, new_process):
        """When the hit rank's group next committed a step of the full quorum after `since`
        (from a new process where it was killed), or None."""
        f, pid = hit
        for l in lines_of(self.log(f)):
            if l["t_ns"] >= since * 1e9 and (l["pid"] != pid or not new_process) and \
                    len(l["members"]) == self.a.replicas:
                return l["t_ns"] / 1e9
        return None

    def inject(self, kind):
        groups = self.rng.sample(range(self.a.replicas), 2)
        now = time.time()
        hits, since, new_process = [], now, True
        if kind == "worker_kill":
            hits = [self.signal(groups[0], signal.SIGKILL)]
        elif kind == "worker_stop":
            hits = [self.signal(groups[0], signal.SIGSTOP)]
            time.sleep(self.a.stop_seconds)
            if hits[0]:
                os.kill(hits[0][1], signal.SIGCONT)
            since, new_process = time.time(), False
        elif kind == "two_replicas_kill":
            hits = [self.signal(groups[0], signal.SIGKILL), self.signal(groups[1], signal.SIGKILL)]
        elif kind == "node_kill":
            node = self.rng.randrange(1, self.a.nodes)
            per_node = self.a.replicas // self.a.nodes
            hits = []
            for g in range(node * per_node, (node + 1) * per_node):
                f = g * self.a.ranks
                l = self.last(f)
                if l is not None:
                    hits.append((f, l["pid"]))
            groups = list(range(node * per_node, (node + 1) * per_node))
            self.kill_node(node)
            time.sleep(self.a.node_down)
            self.start_node(node)
        elif kind == "kill_during_recovery":
            hits = [self.signal(groups[0], signal.SIGKILL)]
            time.sleep(self.a.heartbeat_timeout + 1.0)  # its restart registers and recovers about now
            hits.append(self.signal(groups[1], signal.SIGKILL))
        shown = groups if kind == "node_kill" else groups[:2] if kind in OVERLAP else groups[:1]
        print(f"[chaos-ft] {kind} of groups {shown} "
              f"at step {self.newest_step()}", flush=True)
        self.faults.append((kind, now, [h for h in hits if h], since, new_process))

    def node_command(self, node):
        a = self.a
        gpt = os.path.join(a.build, "examples", "gpt")
        layout = []
        if a.nodes > 1:
            layout = ["--nnodes", str(a.nodes), "--node-rank", str(node), "--rdzv-endpoint", self.endpoint]
        return [os.path.join(a.build, "tools", "dtrain"), "run", *layout,
               "--nproc-per-node", str(self.world // a.nodes),
               "--ft-replicas", str(a.replicas), "--max-restarts", str(a.max_restarts),
               "--ft-heartbeat-timeout", str(a.heartbeat_timeout),
               "--log-dir", os.path.join(self.dir, f"logs{node}.{len(self.errs)}"),
               gpt, "--strategy", "zero2", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
               "--batch-size", str(BATCH), "--max-iters", str(a.steps), "--eval-interval", "100000",
               "--eval-iters", "1", "--sample-tokens", "0", "--devices", "cpu",
               "--sample-log", os.path.join(self.dir, "samples.jsonl")]

    def start_node(self, node):
        err = open(os.path.join(self.dir, f"launcher{node}.{len(self.errs)}.err"), "w")
        self.errs.append(err)
        # A session of its own: a node kill takes its launcher and workers.
        self.nodes[node] = subprocess.Popen(self.node_command(node), stdout=subprocess.DEVNULL, stderr=err,
                                            start_new_session=True)

    def kill_node(self, node):
        try:
            os.killpg(self.nodes[node].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.nodes[node].wait()

    def run(self):
        a = self.a
        assert a.replicas % a.nodes == 0 and self.world % a.nodes == 0, "--replicas and the ranks split over --nodes"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        self.nodes, self.errs = [None] * a.nodes, []
        start = time.time()
        for node in range(a.nodes):
            self.start_node(node)
        proc = self.nodes[0]
        kinds = a.ft_kinds.split(",")
        plan = [kinds[i % len(kinds)] for i in range(a.faults)]
        self.rng.shuffle(plan)
        # Node kills first: a node down and started again takes seconds to
        # come back (launcher, workers, recovery); late in the run the others
        # would finish first, and node 0 stops serving the lighthouse soon
        # after (docs/fault_tolerance.md, "Several nodes": a late node).
        plan.sort(key=lambda k: k != "node_kill")
        last_fault = time.time()
        due = time.time() + self.rng.uniform(a.gap_min, a.gap_max)
        while all(n.poll() is None for n in self.nodes) and time.time() - start < a.timeout:
            time.sleep(0.05)
            if not plan or time.time() < due or not self.all_in_quorum():
                continue
            if self.newest_step() > 0.6 * a.steps:
                break
            if self.faults and not self.recovered(self.faults[-1]):
                continue  # one at a time: wait until the groups hit are back in the full quorum
            self.inject(plan.pop(0))
            last_fault = time.time()
            due = last_fault + self.rng.uniform(a.gap_min, a.gap_max)
        not_fired = plan
        rc = 0
        for node in self.nodes:
            try:
                code = node.wait(timeout=max(1.0, a.timeout - (time.time() - start)))
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                code = node.wait()
            rc = rc or code
        for err in self.errs:
            err.close()
        wall = time.time() - start
        return self.audit(rc, wall, not_fired)

    def audit(self, rc, wall, not_fired):
        a = self.a
        per_micro = self.world * BATCH  # stream positions per step (accumulate 1)
        seen, duplicates, wrong, disagree = set(), 0, 0, 0
        members_of = {}
        committed = set()
        for f in range(self.world):
            for l in lines_of(self.log(f)):
                s = l["step"] - 1
                committed.add(s)
                if l["indices"] != list(range(s * per_micro + f * BATCH, s * per_micro + f * BATCH + BATCH)):
                    wrong += 1
                for i in l["indices"]:
                    duplicates += i in seen
                    seen.add(i)
                m = members_of.setdefault(s, l["members"])
                disagree += m != l["members"] or f // a.ranks not in l["members"]
        skipped = [s for s in range(a.steps) if s not in committed]
        finished = rc == 0 and all((self.last(f) or {}).get("step") == a.steps for f in range(self.world))
        text = "".join(open(e.name).read() for e in self.errs)
        whole = text.count("restarting the workers") + text.count("no restarts left")
        group_restarts = text.count("restarting that replica group only")
        injected = {k: sum(1 for f in self.faults if f[0] == k) for k in KINDS}
        survived = {k: 0 for k in KINDS}
        lost = {}
        for kind, t, hits, since, new_process in self.faults:
            backs = [self.back_after(h, since, new_process) for h in hits]
            if hits and all(b is not None for b in backs):
                survived[kind] += 1
                lost.setdefault(kind, []).append(round(max(backs) - t, 2))
        return {"bench": "chaos_ft", "seed": a.seed, "finished": finished, "exit_code": rc,
                "whole_restarts": whole, "group_restarts": group_restarts, "skipped_steps": len(skipped),
                "duplicates": duplicates, "wrong_samples": wrong, "membership_disagreements": disagree,
                "samples_ok": duplicates == 0 and wrong == 0 and not skipped and disagree == 0,
                "injected": injected, "survived": survived, "to_full_quorum_s": lost, "not_fired": not_fired,
                "steps": a.steps, "replicas": a.replicas, "ranks": a.ranks, "nodes": a.nodes,
                "wall_s": round(wall, 1)}

    def close(self):
        if not self.a.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"[chaos-ft] scratch: {self.dir}")


def soak_ft(a):
    soak = FtSoak(a)
    try:
        r = soak.run()
    finally:
        soak.close()
    print(json.dumps(r), flush=True)
    ok = r["finished"] and r["samples_ok"] and r["whole_restarts"] == 0 and not r["not_fired"] and all(
        r["injected"][k] == r["survived"][k] for k in KINDS)
    return ok
