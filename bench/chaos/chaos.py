"""Chaos soak (issue 15 item 5): three `dtrain run` nodes, each in its own
network namespace on a bridge (loopback when namespaces cannot be made),
train examples/fashion_mnist with DDP and checkpoints while this driver
injects faults at random times drawn from a fixed seed:

  worker_kill      SIGKILL of one worker
  worker_stop      SIGSTOP of one worker (a hung rank: the others' collectives time out)
  node_kill        SIGKILL of a whole node (launcher and, by PDEATHSIG, its workers); restarted later
  store_host_kill  SIGKILL of the node hosting the rendezvous store (store-host failover); restarted later
  link_cut         `ip link set dteth0 down` in a node's namespace for twice the heartbeat timeout
  disk_full        the checkpoint directory (a small tmpfs) filled for a while, then freed

A killed node is started again after a pause, pointed at the current store
host (what a Kubernetes Service in front of the rendezvous gives a real job):
held while no store is up and a survivor is failing over, pointed again if
that host is lost before the node is in a round, and pointed at node 0 (which
hosts afresh) when every member is lost.
Faults come one at a time: the next is due a random 5-9 s after the last and
waits until all three nodes train together again.

--overlap adds faults that do not wait for recovery (issue 30), each one kind:

  cut_then_host_kill  a node's link cut, and the store host killed while it is
                      still down or just as it comes back (the cut node misses
                      the round closed without it, then the host is lost)
  host_kill_twice     the store host killed, then its successor as soon as it hosts
  kill_during_reform  a worker killed, then a node killed while the group re-forms

and lets every fault fire without waiting for the last one's recovery.
--ft runs the fault-tolerant mode instead (chaos_ft.py: `dtrain run
--ft-replicas` on one node or, with --nodes N, N launchers in namespaces;
worker kills and stops, two groups at once, a kill during a recovery, node
kills, link cuts, a cut during a recovery, a full checkpoint disk; the
namespaces and the tmpfs are faults.py's, shared with this mode). --seeds A..B runs the soak once per seed and prints the totals per kind
(injected, survived, median and worst time lost) and each seed's audit.

At the end it checks that training finished, that the final checkpoint loads
(a single process resumes it and reports the same parameters as the run), and
that in every epoch no example was trained on twice or skipped, across world
size changes: per step, the examples of the step's last execution (the one
its checkpoints hold, from the ranks' --sample-log records) are taken, and
each epoch's union must have no duplicates and miss fewer than one global
batch (drop_last). It prints a table and one JSON line with the figures:
faults injected and survived per kind, time lost per kind (from the fault
until the first step of the group re-formed after it), restarts used.
"""
import argparse
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chaos_ft  # noqa: E402
from faults import Lan, SmallDisk  # noqa: E402

KINDS = ["worker_kill", "worker_stop", "node_kill", "store_host_kill", "link_cut", "disk_full"]
OVERLAP_KINDS = ["cut_then_host_kill", "host_kill_twice", "kill_during_reform"]
ALL_KINDS = KINDS + OVERLAP_KINDS
CONF = "last_call_timeout=1,heartbeat_interval=0.25,heartbeat_timeout=3"
HEARTBEAT_TIMEOUT = 3.0


class Node:
    def __init__(self, index, soak):
        self.index, self.soak, self.proc, self.starts = index, soak, None, 0

    def start(self, endpoint_index):
        s = self.soak
        self.starts += 1
        self.endpoint = endpoint_index
        endpoint_host = s.lan.address(endpoint_index)
        self.log = os.path.join(s.dir, f"node{self.index}.{self.starts}.log")
        args = s.lan.wrap(self.index) + [
            s.dtrain, "run", "--nnodes", "2:3", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"{endpoint_host}:{s.port}", "--rdzv-id", "chaos", "--rdzv-conf", CONF,
            "--rdzv-timeout", "60", "--max-restarts", str(s.args.max_restarts), "--stop-grace", "2",
            s.example, "--strategy", "ddp", "--devices", "cpu", "--epochs", str(s.args.epochs),
            "--train-limit", str(s.args.train_limit), "--batch-size", str(s.args.batch_size),
            "--seed", "3", "--checkpoint-dir", s.ckpt, "--checkpoint-every", str(s.args.checkpoint_every),
            "--sample-log", os.path.join(s.dir, "samples.jsonl")]
        env = dict(os.environ, OMP_NUM_THREADS="1", DTRAIN_TIMEOUT_SECONDS="10")
        if s.lan.usable:
            env["GLOO_SOCKET_IFNAME"] = "dteth0"
        self.proc = subprocess.Popen(args, stdout=open(self.log + ".out", "w"), stderr=open(self.log, "w"),
                                     env=env, start_new_session=True)

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def seeking(self):
        """Failing over: lost its store (or followed one that yielded) and not yet in the next one."""
        text = self.text()
        lost = max(text.rfind("lost the rendezvous store at"), text.rfind("yielded to the one at"))
        found = max(text.rfind("hosting the rendezvous store of generation"),
                    text.rfind("joined the rendezvous store of generation"))
        return lost > found

    def joined(self):
        """A member of a round (not just arrived, perhaps at a store no one else uses)."""
        return re.search(r"round \d+: node rank", self.text()) is not None

    def text(self):
        return open(self.log, errors="replace").read() if self.proc else ""

    def workers(self):
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return [int(p) for p in out]


class Soak:
    def __init__(self, args):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="dtrain-chaos-")
        self.ckpt = os.path.join(self.dir, "ckpt")
        self.disk = SmallDisk(self.ckpt, args.ckpt_mb)
        self.tmpfs = self.disk.usable
        self.lan = Lan(3)
        self.port = 29000 + os.getpid() % 1000
        self.dtrain = os.path.join(args.build, "tools", "dtrain")
        self.example = os.path.join(args.build, "examples", "fashion_mnist")
        self.nodes = [Node(i, self) for i in range(3)]
        self.events = []  # (time, kind, step at the fault)
        self.pending_restarts = []  # (due, node)
        self.followups = []  # (due, what): second halves of overlapping faults

    def close(self):
        for n in self.nodes:
            if n.alive():
                os.killpg(n.proc.pid, signal.SIGKILL)
        self.disk.close()
        self.lan.close()

    # ---- observation ----
    def records(self):
        out = []
        for path in glob.glob(os.path.join(self.dir, "samples.rank*.jsonl")):
            with open(path) as f:
                for line in f:
                    if line.endswith("\n"):
                        out.append(json.loads(line))
        return out

    def step_now(self):
        r = self.records()
        return max((x["step"] for x in r), default=0)

    def host(self):
        """Index of the live node hosting the store of the newest generation (0 when none does)."""
        best, best_gen = 0, -1
        for n in self.nodes:
            if not n.alive():
                continue
            text = n.text()
            gens = [int(g) for g in re.findall(r"hosting the rendezvous store of generation (\d+)", text)]
            if "hosting the rendezvous store on port" in text and n.endpoint == n.index:
                gens.append(0)
            joined = [m.start() for m in re.finditer(r"joined the rendezvous store of generation|yielded to", text)]
            hosted = [m.start() for m in re.finditer(r"hosting the rendezvous store of generation", text)]
            if joined and (not hosted or max(joined) > max(hosted)):
                gens = []
            if gens and max(gens) > best_gen:
                best, best_gen = n.index, max(gens)
        return best

    def restarts(self):
        used = 0
        for path in glob.glob(os.path.join(self.dir, "node*.log")):
            for m in re.finditer(r"restarts so far (\d+)", open(path, errors="replace").read()):
                used = max(used, int(m.group(1)))
        return used

    def recovered(self):
        """Faults come one at a time: the next waits until all three nodes train together again.
        A step a group of world 3 logs after the fault is not enough: the step in flight when a
        process died can still complete on the others. After a fault that ends the round (a
        process killed), recovery is a world-3 step of a later round; after the others, a
        world-3 step at least two past the step at the fault."""
        if not self.events:
            return True
        ev = self.events[-1]
        regroup = ev["kind"] in ("worker_kill", "node_kill", "store_host_kill")
        for r in self.records():
            if r["t_ns"] / 1e9 <= ev["t"] or r["world"] != 3:
                continue
            if (r["round"] != ev["round"]) if regroup else (r["step"] >= ev["step"] + 2):
                return True
        return False

    # ---- faults ----
    def inject(self, kind, rng):
        alive = [n for n in self.nodes if n.alive()]
        host = self.host()
        if kind in ("worker_kill", "worker_stop"):
            node = rng.choice(alive)
            pids = node.workers()
            if not pids:
                return False
            os.kill(rng.choice(pids), signal.SIGKILL if kind == "worker_kill" else signal.SIGSTOP)
            return True
        if kind in ("node_kill", "store_host_kill"):
            candidates = [n for n in alive if (n.index == host) == (kind == "store_host_kill")]
            if not candidates or len(alive) < 3:
                return False
            node = rng.choice(candidates)
            self.kill(node)
            return True
        if kind == "link_cut":
            if not self.lan.usable:
                return False
            candidates = [n for n in alive if n.index != host]
            if not candidates:
                return False
            node = rng.choice(candidates).index
            self.lan.cut(node)
            self.pending_link = (time.time() + 2 * HEARTBEAT_TIMEOUT, node)
            return True
        if kind == "cut_then_host_kill":
            if len(alive) < 3 or not self.inject("link_cut", rng):
                return False
            # The host dies while the link is down, or just as it comes back (the issue-30 history).
            self.followups.append((time.time() + rng.uniform(1.0, 2 * HEARTBEAT_TIMEOUT + 0.5), "host"))
            return True
        if kind == "host_kill_twice":
            if len(alive) < 3 or not self.inject("store_host_kill", rng):
                return False
            self.followups.append((time.time(), "successor"))
            return True
        if kind == "kill_during_reform":
            if len(alive) < 3 or not self.inject("worker_kill", rng):
                return False
            self.followups.append((time.time() + rng.uniform(0.5, 2.5), "node"))
            return True
        if kind == "disk_full":
            if not self.tmpfs:
                return False
            self.disk.fill()
            self.pending_disk = time.time() + self.args.disk_full_seconds
            return True
        raise ValueError(kind)

    def kill(self, node):
        os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait()
        self.pending_restarts.append((time.time() + self.args.restart_after, node))

    def follow_up(self, what, since):
        """The second half of an overlapping fault; False while it is not due yet."""
        alive = [n for n in self.nodes if n.alive()]
        if what == "host":
            host = self.host()
            victims = [n for n in alive if n.index == host]
        elif what == "successor":  # kill the next host as soon as one hosts a newer generation
            first = self.events[-1]["host_gen"] if self.events else 0
            victims = [n for n in alive if self.hosted_generation(n) > first]
            if not victims and time.time() - since < 20:
                return False
        else:
            victims = [n for n in alive if n.workers()]
        if victims:
            self.kill(victims[0] if what != "node" else random.Random(since).choice(victims))
            print(f"[chaos] t={time.time() - self.t_first:6.1f}s   then {what} killed", flush=True)
        return True

    def hosted_generation(self, node):
        gens = [int(g) for g in re.findall(r"hosting the rendezvous store of generation (\d+)", node.text())]
        return max(gens, default=0)

    def hosting(self):
        """Index of the live node that hosts the newest store now; None while none does."""
        h = self.nodes[self.host()]
        if not h.alive() or h.seeking():
            return None
        text = h.text()
        if "hosting the rendezvous store" not in text or (h.endpoint != h.index and
                                                         "hosting the rendezvous store of generation" not in text):
            return None
        return h.index

    def housekeeping(self):
        """A killed node comes back pointed at the current store host, as a Kubernetes Service in front
        of the rendezvous would route it: not while no node hosts a store (every survivor is still
        failing over; a Service has no ready endpoint then), and a restarted node that has not joined
        a round yet is pointed again when the host it was given is lost. When no store is up and no
        live node was ever in a round since it started (every member lost: a job restart), nodes
        are pointed at node 0's address, and node 0 hosts afresh there."""
        now = time.time()
        target = self.hosting()
        if target is None and not any(n.alive() and (n.seeking() or n.joined()) for n in self.nodes):
            target = 0  # every member is lost (the live nodes came since, in no round): the job starts afresh
        for due, node in [p for p in self.pending_restarts if now >= p[0]]:
            if target is None and now - due < self.args.restart_hold:
                continue
            node.start(target if target is not None else self.host())
            self.pending_restarts.remove((due, node))
        for n in self.nodes:
            if n.alive() and n.starts > 1 and not n.joined() and target is not None and n.endpoint != target:
                os.killpg(n.proc.pid, signal.SIGKILL)
                n.proc.wait()
                n.start(target)
                print(f"[chaos] t={now - self.t_first:6.1f}s   node {n.index} (not in a round yet) pointed again, "
                      f"at node {target}", flush=True)
        for item in [f for f in self.followups if now >= f[0]]:
            if self.follow_up(item[1], item[0]):
                self.followups.remove(item)
        if getattr(self, "pending_link", None) and now >= self.pending_link[0]:
            self.lan.mend(self.pending_link[1])
            self.pending_link = None
        if getattr(self, "pending_disk", None) and now >= self.pending_disk:
            self.disk.free()
            self.pending_disk = None

    def run(self):
        a = self.args
        rng = random.Random(a.seed)
        kinds = [k for k in a.kinds.split(",") if k]
        plan = [kinds[i % len(kinds)] for i in range(a.faults)]
        rng.shuffle(plan)
        self.nodes[0].start(0)
        time.sleep(1.0)
        self.nodes[1].start(0)
        self.nodes[2].start(0)
        start = time.time()
        while self.step_now() < 1 and time.time() - start < 120:
            time.sleep(0.2)
        t_first = self.t_first = time.time()
        next_fault = t_first + rng.uniform(a.gap_min, a.gap_max)
        deadline = t_first + a.timeout
        while time.time() < deadline:
            self.housekeeping()
            if not any(n.alive() for n in self.nodes) and not self.pending_restarts:
                break
            busy = self.pending_restarts or self.followups or any(
                getattr(self, p, None) for p in ("pending_link", "pending_disk"))
            if a.overlap:  # faults do not wait for recovery, only for their own kind's resources
                busy = getattr(self, "pending_link", None) and plan and plan[0] in ("link_cut", "cut_then_host_kill")
            if plan and not busy and time.time() >= next_fault and (a.overlap or self.recovered()):
                kind = plan[0]
                recs = self.records()
                step = max((x["step"] for x in recs), default=0)
                round_now = max(((x["t_ns"], x["round"]) for x in recs), default=(0, -1))[1]  # the newest record's
                host_gen = max((self.hosted_generation(n) for n in self.nodes if n.alive()), default=0)
                if self.inject(kind, rng):
                    self.events.append({"kind": kind, "t": time.time(), "step": step, "round": round_now,
                                        "host_gen": host_gen})
                    print(f"[chaos] t={time.time() - t_first:6.1f}s {kind} at step {step}", flush=True)
                    plan.pop(0)
                next_fault = time.time() + rng.uniform(a.gap_min, a.gap_max)
            time.sleep(0.1)
        self.t_end = time.time()
        self.unfired = plan
        return self.check()

    # ---- verdict ----
    def check(self):
        a = self.args
        codes = [n.proc.poll() for n in self.nodes if n.proc is not None]
        finished = bool(codes) and all(c == 0 for c in codes)
        done = None
        for n in self.nodes:
            for path in glob.glob(n.log.rsplit(".", 2)[0] + ".*.log.out"):
                for line in open(path):
                    if line.startswith('{"event":"done"'):
                        done = json.loads(line)
        # The final checkpoint loads: one process resumes it (nothing left to train) and reports the parameters.
        resumed = subprocess.run(
            [self.example, "--strategy", "single", "--devices", "cpu", "--epochs", str(a.epochs), "--train-limit",
             str(a.train_limit), "--batch-size", str(a.batch_size), "--seed", "3", "--checkpoint-dir", self.ckpt],
            capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        loaded = None
        for line in resumed.stdout.splitlines():
            if line.startswith('{"event":"done"'):
                loaded = json.loads(line)
        checkpoint_ok = bool(done and loaded and loaded["params_fnv"] == done["params_fnv"])
        # Sample audit.
        recs = self.records()
        # A step's execution: its records of one round within a moment of each other. Round numbers
        # alone do not tell executions apart: a store hosted afresh (every node lost) counts from 0 again.
        latest = {}  # step -> (t, round)
        for r in recs:
            if r["step"] not in latest or r["t_ns"] > latest[r["step"]][0]:
                latest[r["step"]] = (r["t_ns"], r["round"])
        per_epoch, batch_max = {}, {}
        for r in recs:
            t, rnd = latest[r["step"]]
            if rnd == r["round"] and t - r["t_ns"] < 2e9:
                per_epoch.setdefault(r["epoch"], []).extend(r["indices"])
                batch_max[r["epoch"]] = max(batch_max.get(r["epoch"], 0), len(r["indices"]) * r["world"])
        steps = sorted(latest)
        contiguous = steps == list(range(1, len(steps) + 1))
        audit = {}
        for e, idx in sorted(per_epoch.items()):
            audit[e] = {"examples": len(idx), "duplicates": len(idx) - len(set(idx)),
                        "missing": a.train_limit - len(set(idx)), "global_batch": batch_max[e]}
        samples_ok = contiguous and len(audit) == a.epochs and all(
            v["duplicates"] == 0 and 0 <= v["missing"] < v["global_batch"] for v in audit.values())
        # Time lost: from the fault until the first step of a round formed after it (the group
        # re-formed and trains again); when no new round formed (the fault cost nothing), until the next step.
        lost = {}
        for ev in self.events:
            before = [(r["t_ns"], r["round"]) for r in recs if r["t_ns"] / 1e9 <= ev["t"]]
            round_at = max(before, default=(0, -1))[1]  # the newest record's (a fresh store counts from 0)
            later = [r["t_ns"] / 1e9 for r in recs if r["round"] != round_at and r["t_ns"] / 1e9 > ev["t"]]
            nxt = [r["t_ns"] / 1e9 for r in recs if r["t_ns"] / 1e9 > ev["t"]]
            back = min(later) if later else (min(nxt) if nxt else self.t_end)
            lost.setdefault(ev["kind"], []).append(round(back - ev["t"], 2))
        injected = {k: sum(1 for e in self.events if e["kind"] == k) for k in ALL_KINDS}
        survived = {k: (injected[k] if finished else 0) for k in ALL_KINDS}
        result = {"bench": "chaos", "finished": finished, "exit_codes": codes, "checkpoint_loads": checkpoint_ok,
                  "samples_ok": samples_ok, "steps": len(steps), "audit": audit, "injected": injected,
                  "survived": survived, "not_fired": self.unfired, "time_lost_s": lost,
                  "restarts_used": self.restarts(), "namespaces": self.lan.usable, "tmpfs": self.tmpfs,
                  "wall_s": round(self.t_end - (self.events[0]["t"] if self.events else self.t_end), 1)}
        return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=12)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--train-limit", type=int, default=48000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--max-restarts", type=int, default=40)
    p.add_argument("--gap-min", type=float, default=5.0)
    p.add_argument("--gap-max", type=float, default=9.0)
    p.add_argument("--restart-after", type=float, default=4.0)
    p.add_argument("--restart-hold", type=float, default=30.0,
                   help="longest a restart waits for a store host to point the node at")
    p.add_argument("--disk-full-seconds", type=float, default=6.0)
    p.add_argument("--ckpt-mb", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, records)")
    p.add_argument("--overlap", action="store_true",
                   help="add the overlapping kinds, and let faults fire without waiting for recovery")
    p.add_argument("--seeds", default="", help="A..B: one soak per seed, with totals per kind")
    p.add_argument("--ft", action="store_true",
                   help="fault-tolerant mode (chaos_ft.py): --ft-replicas groups of the GPT on --nodes launchers")
    chaos_ft.add_arguments(p)
    a = p.parse_args()
    if a.ft:
        sys.exit(0 if chaos_ft.soak_ft(a) else 1)
    if a.overlap and a.kinds == ",".join(KINDS):
        a.kinds = ",".join(ALL_KINDS)
    seeds = [a.seed]
    if a.seeds:
        lo, hi = (int(x) for x in a.seeds.split(".."))
        seeds = list(range(lo, hi + 1))
    results = []
    for seed in seeds:
        a.seed = seed
        print(f"[chaos] seed {seed}", flush=True)
        results.append((seed, soak_once(a)))
    if len(results) > 1:
        summarize(results)
    sys.exit(0 if all(ok(r) for _, r in results) else 1)


def ok(result):
    return result["finished"] and result["checkpoint_loads"] and result["samples_ok"] and not result["not_fired"]


def soak_once(a):
    soak = Soak(a)
    try:
        result = soak.run()
    finally:
        soak.close()
    print(f"[chaos] scratch: {soak.dir}")
    print("kind                injected  survived  time lost (s, each)")
    for k in ALL_KINDS:
        if result["injected"][k]:
            print(f"{k:20s}{result['injected'][k]:>8d}{result['survived'][k]:>10d}  {result['time_lost_s'].get(k, [])}")
    print(f"finished {result['finished']}  checkpoint loads {result['checkpoint_loads']}  samples ok "
          f"{result['samples_ok']}  steps {result['steps']}  restarts used {result['restarts_used']}")
    result["seed"] = a.seed
    print(json.dumps(result), flush=True)
    if not a.keep:
        shutil.rmtree(soak.dir, ignore_errors=True)
    return result


def summarize(results):
    """Totals over seeds: per kind injected / survived, median and worst time lost; per seed its verdict."""
    print(f"[chaos] {len(results)} seeds")
    print("kind                injected  survived  median lost (s)  worst lost (s)")
    totals = {}
    for k in ALL_KINDS:
        inj = sum(r["injected"][k] for _, r in results)
        sur = sum(r["survived"][k] for _, r in results)
        lost = sorted(x for _, r in results for x in r["time_lost_s"].get(k, []))
        med = lost[len(lost) // 2] if lost else None
        worst = lost[-1] if lost else None
        totals[k] = {"injected": inj, "survived": sur, "median_lost_s": med, "worst_lost_s": worst}
        if inj:
            print(f"{k:20s}{inj:>8d}{sur:>10d}  {med!s:>15s}  {worst!s:>14s}")
    for seed, r in results:
        worst_missing = max((v["missing"] for v in r["audit"].values()), default=None)
        dups = sum(v["duplicates"] for v in r["audit"].values())
        print(f"seed {seed:4d}: {'ok  ' if ok(r) else 'FAIL'} finished {r['finished']} checkpoint {r['checkpoint_loads']} "
              f"samples {r['samples_ok']} (duplicates {dups}, worst missing {worst_missing}) "
              f"restarts {r['restarts_used']} wall {r['wall_s']} s")
    print(json.dumps({"bench": "chaos", "seeds": [s for s, _ in results], "passed": sum(ok(r) for _, r in results),
                      "totals": totals, "restarts_used": [r["restarts_used"] for _, r in results]}))


if __name__ == "__main__":
    main()
