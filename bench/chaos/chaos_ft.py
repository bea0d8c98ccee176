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
  store_host_kill       (--nodes N > 1) SIGKILL of node 0, the lighthouse's host (its launcher and
                        workers): node 1's standby lighthouse (--ft-lighthouse-standby) serves once
                        node 0's has been silent for --failover-timeout, node 1's groups reconnect to
                        it and step on; node 0 is started again (same command) once the standby
                        serves and --node-down has passed, hosts no lighthouse, and its groups
                        recover live from a peer (Note [Lighthouse failover])
  link_cut              (--nodes N > 1, root) the link of a node other than node 0 cut for
                        --cut-seconds (twice the heartbeat timeout unless given): every node runs in
                        a network namespace of its own, with a /dev/shm of its own, so the groups of
                        two nodes talk over the network as on two hosts (faults.py, shared with
                        chaos.py); the cut node's groups are dropped from the quorum, and come back
                        (restarted by their launcher if their lighthouse calls timed out meanwhile)
                        and recover live
  cut_during_recovery   (--nodes N > 1, root) a rank of a group of node 0 SIGKILLed, and node 1's link
                        cut as the group restarts and recovers: node 0's other group carries the
                        job alone for a while
  disk_full             (root) the checkpoint directory, a --ckpt-mb tmpfs the GPT checkpoints into
                        every --ft-checkpoint-every steps, filled until a checkpoint write has failed,
                        then freed: the writing group warns and trains on (no restart); the
                        checkpoints left must verify (every file's size and CRC32 as its MANIFEST
                        says) and the run's last one be written after the disk was freed

With --nodes N the job is N launchers on loopback (`dtrain run --nnodes N
--node-rank I --ft-replicas G`, G/N groups each), node 0 hosting the
lighthouse at the rendezvous endpoint and node 1 its standby
(docs/fault_tolerance.md, "Several nodes"). A store_host_kill comes after
every other node fault: after it node 1 hosts the job's only lighthouse, and
a kill of node 1 then would stop the job (docs/fault_tolerance.md, Limits).

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
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import zlib

from faults import Lan, SmallDisk

KINDS = ["worker_kill", "worker_stop", "two_replicas_kill", "kill_during_recovery", "node_kill", "link_cut",
         "cut_during_recovery", "disk_full", "store_host_kill"]
NEEDS_NODES = {"node_kill", "link_cut", "cut_during_recovery", "store_host_kill"}
TOOK_OVER = "standby lighthouse: the lighthouse at"  # node 1's launcher log when its standby serves
CUTS = {"link_cut", "cut_during_recovery"}
FAILED_WRITE = "could not write checkpoint step"  # the Trainer's warning (Note [Failed checkpoint writes])
OVERLAP = {"two_replicas_kill", "kill_during_recovery", "cut_during_recovery"}
BATCH = 2


def add_arguments(p):
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="ranks per replica group")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--ft-kinds", default=",".join(k for k in KINDS if k not in NEEDS_NODES | {"disk_full"}))
    p.add_argument("--nodes", type=int, default=1, help="launchers on loopback, node 0 hosting the lighthouse")
    p.add_argument("--node-down", type=float, default=1.5, help="seconds a killed node stays down")
    p.add_argument("--stop-seconds", type=float, default=2.0)
    p.add_argument("--heartbeat-timeout", type=float, default=0.5)
    p.add_argument("--cut-seconds", type=float, default=0.0, help="link_cut's length (0: twice the heartbeat timeout)")
    p.add_argument("--ft-checkpoint-every", type=int, default=20, help="with disk_full: steps between checkpoints")
    p.add_argument("--failover-timeout", type=float, default=2.0,
                   help="with --nodes > 1: seconds node 0's lighthouse may be silent before node 1's standby serves")


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
        self.faults = []  # (kind, time, hits, since, new_process)
        kinds = a.ft_kinds.split(",")
        self.lan = self.disk = None
        if CUTS & set(kinds):
            assert a.nodes > 1, "link cuts need --nodes 2 or more"
            self.lan = Lan(a.nodes)
        if "disk_full" in kinds:
            self.disk = SmallDisk(os.path.join(self.dir, "ckpt"), a.ckpt_mb)
        self.disk_checks = []  # per disk_full: (a write failed, the checkpoints verified after freeing, freed at)

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
            groups, hits = self.node_hits(node)
            self.kill_node(node)
            time.sleep(self.a.node_down)
            self.start_node(node)
        elif kind == "store_host_kill":
            groups, hits = self.node_hits(0)
            self.kill_node(0)
            deadline = time.time() + 60
            while not self.standby_serves() and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(self.a.node_down)
            self.start_node(0)
        elif kind == "link_cut":
            node = self.rng.randrange(1, self.a.nodes)
            groups, hits = self.node_hits(node)
            self.lan.cut(node)
            time.sleep(self.a.cut_seconds or 2 * self.a.heartbeat_timeout)
            self.lan.mend(node)
            # Back once its groups commit full-quorum steps again, from the same processes
            # or from restarted ones (their lighthouse calls may have timed out meanwhile).
            since, new_process = time.time(), False
        elif kind == "cut_during_recovery":
            per_node = self.a.replicas // self.a.nodes
            killed = self.rng.randrange(per_node)  # a group of node 0: node 0's other one stays up to date
            hits = [self.signal(killed, signal.SIGKILL)]
            time.sleep(self.a.heartbeat_timeout + 1.0)  # its restart registers and recovers about now
            node = self.rng.randrange(1, self.a.nodes)
            cut_groups, cut_hits = self.node_hits(node)
            groups = [killed] + cut_groups
            hits += cut_hits
            self.lan.cut(node)
            time.sleep(self.a.cut_seconds or 2 * self.a.heartbeat_timeout)
            self.lan.mend(node)
            since, new_process = time.time(), False  # the killed group's restart, the cut ones' any process
        elif kind == "disk_full":
            groups = []
            self.disk_full()
            since, new_process = time.time(), False
        elif kind == "kill_during_recovery":
            hits = [self.signal(groups[0], signal.SIGKILL)]
            time.sleep(self.a.heartbeat_timeout + 1.0)  # its restart registers and recovers about now
            hits.append(self.signal(groups[1], signal.SIGKILL))
        shown = groups if kind in NEEDS_NODES | {"disk_full"} else groups[:2] if kind in OVERLAP else groups[:1]
        print(f"[chaos-ft] {kind} of groups {shown} "
              f"at step {self.newest_step()}", flush=True)
        self.faults.append((kind, now, [h for h in hits if h], since, new_process))

    def standby_serves(self):
        """Whether node 1's standby lighthouse took over (its launcher's log says so)."""
        return any(TOOK_OVER in open(e.name, errors="replace").read() for e in self.errs
                   if os.path.basename(e.name).startswith("launcher1."))

    def node_hits(self, node):
        """The groups of `node` and, for each, its rank 0's (log file, pid)."""
        per_node = self.a.replicas // self.a.nodes
        groups = list(range(node * per_node, (node + 1) * per_node))
        hits = []
        for g in groups:
            l = self.last(g * self.a.ranks)
            if l is not None:
                hits.append((g * self.a.ranks, l["pid"]))
        return groups, hits

    def failed_writes(self):
        """How many checkpoint writes the workers reported failed (their logs under --log-dir)."""
        n = 0
        for path in glob.glob(os.path.join(self.dir, "logs*", "**", "*"), recursive=True):
            if os.path.isfile(path):
                with open(path, errors="replace") as f:
                    n += f.read().count(FAILED_WRITE)
        return n

    def disk_full(self):
        """Once a checkpoint is there, fills the checkpoint disk until a write has failed (at most
        30 s), then frees it and verifies the checkpoints left there: the newest one from before
        the fill (or a newer one) is intact."""
        deadline = time.time() + 30
        while not self.checkpoints() and time.time() < deadline:
            time.sleep(0.1)
        good = max(self.checkpoints(), default=None)
        before = self.failed_writes()
        self.disk.fill()
        deadline = time.time() + 30
        while self.failed_writes() == before and time.time() < deadline and \
                all(n.poll() is None for n in self.nodes):
            time.sleep(0.2)
        failed = self.failed_writes() > before
        self.disk.free()
        kept = good is not None and max(self.checkpoints(), default=-1) >= good
        self.disk_checks.append((failed, kept and self.checkpoints_verify(), time.time()))

    def checkpoints(self):
        """The complete checkpoints (step_N folders with a MANIFEST) as {N: folder}."""
        out = {}
        for d in glob.glob(os.path.join(self.disk.path, "step_*")):
            if os.path.exists(os.path.join(d, "MANIFEST")):
                out[int(d.rsplit("_", 1)[1])] = d
        return out

    def checkpoints_verify(self):
        """Whether there is a complete checkpoint and every file of each has the size and CRC32
        its MANIFEST lists. A step pruned while it is read counts as verified (the writer's `keep`)."""
        found = self.checkpoints()
        for step, d in found.items():
            try:
                with open(os.path.join(d, "MANIFEST")) as f:
                    files = json.load(f)["files"]
                for rel, want in files.items():
                    with open(os.path.join(d, rel), "rb") as f:
                        data = f.read()
                    if len(data) != want["bytes"] or zlib.crc32(data) != want["crc32"]:
                        print(f"[chaos-ft] checkpoint step {step}: {rel} fails its size or CRC32", flush=True)
                        return False
            except FileNotFoundError:
                if os.path.exists(d):
                    print(f"[chaos-ft] checkpoint step {step} misses a file", flush=True)
                    return False
        return bool(found)

    def node_command(self, node):
        a = self.a
        gpt = os.path.join(a.build, "examples", "gpt")
        layout = []
        if a.nodes > 1:
            layout = ["--nnodes", str(a.nodes), "--node-rank", str(node), "--rdzv-endpoint", self.endpoint,
                      "--ft-lighthouse-standby", self.standby, "--ft-failover-timeout", str(a.failover_timeout)]
        checkpoints = []
        if self.disk:
            checkpoints = ["--checkpoint-dir", self.disk.path, "--eval-interval", str(a.ft_checkpoint_every)]
        wrap = self.lan.wrap(node, own_shm=True) if self.lan else []
        return wrap + [os.path.join(a.build, "tools", "dtrain"), "run", *layout,
               "--nproc-per-node", str(self.world // a.nodes),
               "--ft-replicas", str(a.replicas), "--max-restarts", str(a.max_restarts),
               "--ft-heartbeat-timeout", str(a.heartbeat_timeout),
               "--log-dir", os.path.join(self.dir, f"logs{node}.{len(self.errs)}"),
               gpt, "--strategy", "zero2", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
               "--batch-size", str(BATCH), "--max-iters", str(a.steps), "--eval-interval", "100000",
               "--eval-iters", "1", "--sample-tokens", "0", "--devices", "cpu",
               "--sample-log", os.path.join(self.dir, "samples.jsonl"), *checkpoints]

    def start_node(self, node):
        err = open(os.path.join(self.dir, f"launcher{node}.{len(self.errs)}.err"), "w")
        self.errs.append(err)
        # A session of its own: a node kill takes its launcher and workers.
        env = dict(os.environ)
        if self.lan:
            env["GLOO_SOCKET_IFNAME"] = "dteth0"  # the node's own address, not the host name's
        self.nodes[node] = subprocess.Popen(self.node_command(node), stdout=subprocess.DEVNULL, stderr=err,
                                            start_new_session=True, env=env)

    def kill_node(self, node):
        try:
            os.killpg(self.nodes[node].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.nodes[node].wait()

    def run(self):
        a = self.a
        assert a.replicas % a.nodes == 0 and self.world % a.nodes == 0, "--replicas and the ranks split over --nodes"
        unusable = [what for what, ok in (("link_cut: network namespaces", self.lan is None or self.lan.usable),
                                           ("disk_full: a tmpfs", self.disk is None or self.disk.usable)) if not ok]
        if unusable:
            return {"bench": "chaos_ft", "unsupported": "needs root and iproute2 for " + ", ".join(unusable)}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"{self.lan.address(0) if self.lan else '127.0.0.1'}:{port}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            standby_port = s.getsockname()[1]
        self.standby = f"{self.lan.address(1) if self.lan else '127.0.0.1'}:{standby_port}"
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
        # The store-host kill last of them: node 1 then hosts the only lighthouse.
        plan.sort(key=lambda k: (k not in NEEDS_NODES, k == "store_host_kill"))
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
        disk_checks = iter(self.disk_checks)
        final_checkpoint = self.disk is not None and max(self.checkpoints(), default=-1) == a.steps
        for kind, t, hits, since, new_process in self.faults:
            if kind == "disk_full":
                # Survived: a write failed (the fault hit), the checkpoints left verified, the
                # group trained on (no restart: the test counts them) and wrote the last one.
                failed, verified, freed = next(disk_checks)
                if failed and verified and final_checkpoint and self.checkpoints_verify():
                    survived[kind] += 1
                    lost.setdefault(kind, []).append(round(freed - t, 2))  # the disk's time full
                continue
            backs = [self.back_after(h, since, new_process) for h in hits]
            if hits and all(b is not None for b in backs):
                survived[kind] += 1
                lost.setdefault(kind, []).append(round(max(backs) - t, 2))
        return {"bench": "chaos_ft", "seed": a.seed, "finished": finished, "exit_code": rc,
                "whole_restarts": whole, "group_restarts": group_restarts, "skipped_steps": len(skipped),
                "duplicates": duplicates, "wrong_samples": wrong, "membership_disagreements": disagree,
                "samples_ok": duplicates == 0 and wrong == 0 and not skipped and disagree == 0,
                "injected": injected, "survived": survived, "to_full_quorum_s": lost, "not_fired": not_fired,
                "failed_checkpoint_writes": self.failed_writes() if self.disk else 0,
                "steps": a.steps, "replicas": a.replicas, "ranks": a.ranks, "nodes": a.nodes,
                "wall_s": round(wall, 1)}

    def close(self):
        for node in getattr(self, "nodes", None) or []:
            if node is not None and node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        if self.disk:
            self.disk.close()
        if self.lan:
            self.lan.close()
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
    if "unsupported" in r:
        return False
    ok = r["finished"] and r["samples_ok"] and r["whole_restarts"] == 0 and not r["not_fired"] and all(
        r["injected"][k] == r["survived"][k] for k in KINDS)
    return ok
