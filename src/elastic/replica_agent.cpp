// The launcher's agent for fault-tolerant replica groups
// (include/dtrain/elastic/replica_agent.h).
#include "dtrain/elastic/replica_agent.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <vector>

#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/net.h"
#include "flight_dumps.h"

namespace dtrain::elastic {

struct ReplicaAgent::Replica {
  int id = 0;
  std::unique_ptr<WorkerGroup> workers;
  std::unique_ptr<WorkerStoreHost> store;
  int restarts = 0;
  bool done = false;
  bool succeeded = false;
};

ReplicaAgent::ReplicaAgent(ReplicaAgentOptions options, MakeWorkers make_workers, MakeStoreHost make_store,
                           WorkerStoreHost& lighthouse)
    : options_(std::move(options)),
      make_workers_(std::move(make_workers)),
      make_store_(std::move(make_store)),
      lighthouse_(lighthouse) {
  DTRAIN_CHECK(options_.replicas >= 1, ConfigError, "--ft-replicas " << options_.replicas << " is below 1.",
               "pass the number of replica groups, e.g. --ft-replicas 4");
  DTRAIN_CHECK(options_.nodes >= 1 && options_.node_rank >= 0 && options_.node_rank < options_.nodes &&
                   options_.replicas % options_.nodes == 0,
               ConfigError,
               "--ft-replicas " << options_.replicas << " over " << options_.nodes << " node(s), node rank "
                                << options_.node_rank << ": not an equal share of replica groups per node.",
               "make --ft-replicas a multiple of --nnodes, and --node-rank below it");
  DTRAIN_CHECK(options_.agent.nproc_per_node % local_replicas() == 0, ConfigError,
               "--nproc-per-node " << options_.agent.nproc_per_node << " does not split into this node's "
                                   << local_replicas() << " equal replica groups.",
               "make --nproc-per-node a multiple of --ft-replicas / --nnodes");
  DTRAIN_CHECK(hosts_lighthouse() || (!options_.lighthouse_host.empty() && options_.lighthouse_port > 0), ConfigError,
               "node " << options_.node_rank << " has no lighthouse address (node 0 hosts it).",
               "give every node the same rendezvous endpoint");
  DTRAIN_CHECK(options_.agent.max_restarts >= 0, ConfigError,
               "--max-restarts " << options_.agent.max_restarts << " is negative.", "pass 0 or more");
}

std::map<std::string, std::string> ReplicaAgent::worker_env(int replica, int local_rank, int port, int restarts) const {
  std::map<std::string, std::string> env = options_.agent.extra_env;
  const int k = ranks_per_replica();
  // Each replica group is a job of its own: ranks, world and store are the
  // group's; run_id tells the groups apart.
  const auto contract = dist::to_environment({.rank = local_rank,
                                              .world_size = k,
                                              .local_rank = local_rank,
                                              .local_world_size = k,
                                              .master_addr = options_.agent.master_addr,
                                              .master_port = port,
                                              .agent_store = true,
                                              .restart_count = restarts,
                                              .group_rank = 0,
                                              .max_restarts = options_.agent.max_restarts,
                                              .run_id = options_.agent.run_id + "-replica" + std::to_string(replica),
                                              .role = options_.agent.role});
  for (const auto& [name, value] : contract) env[name] = value;
  // The candidates in order: node 0's, then the standby's (Note
  // [Lighthouse failover]); only the standby once it took over.
  const std::string standby = options_.standby_host + ":" + std::to_string(options_.standby_port);
  const std::string primary =
      (hosts_lighthouse() || options_.lighthouse_host.empty() ? options_.agent.master_addr : options_.lighthouse_host) +
      ":" + std::to_string(lighthouse_port_);
  env["DTRAIN_FT_LIGHTHOUSE"] =
      standby_serves_ ? standby : primary + (options_.standby_host.empty() ? "" : "," + standby);
  env["DTRAIN_FT_REPLICA_ID"] = std::to_string(replica);
  env["DTRAIN_FT_REPLICAS"] = std::to_string(options_.replicas);
  // Each group's ranks are numbered from 0 and restart on their own: one
  // folder per group and start, so no dump overwrites another's.
  if (!options_.agent.flight_dump_dir.empty()) env["DTRAIN_FLIGHT_RECORDER_DIR"] = flight_dump_dir(replica, restarts);
  if (std::getenv("OMP_NUM_THREADS") == nullptr) env["OMP_NUM_THREADS"] = "1";
  return env;
}

std::string ReplicaAgent::flight_dump_dir(int replica, int restarts) const {
  return (std::filesystem::path(options_.agent.flight_dump_dir) / ("replica_" + std::to_string(replica)) /
          ("attempt_" + std::to_string(restarts)))
      .string();
}

void ReplicaAgent::start(Replica& replica) {
  // A fresh store on a fresh port for every start: Note [Worker store]. The
  // host is made before the socket, so nothing can throw while the socket is
  // ours; serve() owns it from then on.
  replica.store.reset();
  replica.store = make_store_();
  int port = 0;
  const int fd = net::listen_tcp(port);
  replica.store->serve(fd, port);
  std::vector<WorkerLaunch> launches;
  const int k = ranks_per_replica();
  for (int r = 0; r < k; ++r) {
    launches.push_back({.local_rank = r, .global_rank = r, .env = worker_env(replica.id, r, port, replica.restarts)});
  }
  replica.workers->start(launches, replica.restarts);
}

void ReplicaAgent::serve_lighthouse() {
  lighthouse_port_ = options_.lighthouse_port;
  if (keeps_standby()) {
    // Its port is bound only when it takes over (standby_lighthouse.h says why).
    lighthouse_.stop();
    lighthouse_.serve(-1, options_.standby_port);
    return;
  }
  if (!hosts_lighthouse()) return;  // node 0's
  if (!options_.standby_host.empty() && options_.lighthouse_serves &&
      options_.lighthouse_serves(options_.standby_host, options_.standby_port)) {
    // Node 0 started again after the standby took over: a lighthouse of its
    // own would split the job in two (Note [Lighthouse failover]).
    standby_serves_ = true;
    DTRAIN_LOG(kWarning) << "the standby lighthouse at " << options_.standby_host << ":" << options_.standby_port
                         << " serves this job (node 0 was lost): this node hosts none, and its replica groups "
                            "join that one and recover from a peer";
    return;
  }
  lighthouse_.stop();
  const int fd = net::listen_tcp(lighthouse_port_);  // binds; lighthouse_port_ is then the port bound
  lighthouse_.serve(fd, lighthouse_port_);
}

// Note [Replica groups on several nodes]
// `dtrain run --nnodes N --node-rank I --ft-replicas G` on each node: the
// launchers do not meet in a rendezvous (the groups are independent jobs;
// the lighthouse is what ties them). Node I runs groups I * G/N .. and
// restarts only those; node 0 also hosts the lighthouse at the rendezvous
// endpoint. A node that dies (its launcher and workers) takes only its
// groups down: the others' quorums drop them after the heartbeat timeout
// and go on; the node's launcher, started again (by the cluster, or a
// person), starts its groups afresh, and they recover live. Node 0 is the
// job's single point, as a store host is, unless node 1 keeps a standby
// (--ft-lighthouse-standby; Note [Lighthouse failover] in
// src/ft/lighthouse_failover.cpp): without one every group fails (a
// CommunicationError within lighthouse_timeout) and the other nodes'
// launchers give up when their restarts run out. At the end, node 0 (or the
// standby, once it serves) serves `linger` longer than its own groups ran,
// so the others' last votes find the lighthouse.

// Note [Whole-job restart of replica groups]
// Live recovery needs a group at the newest step. When the lighthouse finds
// every group that held it gone (Note [End of training] in
// src/ft/lighthouse_end.cpp), the groups left cannot go on: their quorum calls
// fail with ReplicaStateLostError, and the lighthouse's check() throws it.
// The run then falls back to what it does for any whole-job failure: every
// group is stopped and started again with a fresh lighthouse (a new store:
// no step, round or quorum id is carried over), and each resumes from its
// newest checkpoint, if it keeps one (TrainerOptions::checkpoint_dir), or
// from step 0. It counts as a restart of every group: it needs one left in
// each (--max-restarts), and the run fails with the lighthouse's message
// otherwise. A group that finished already means the training is over
// instead: nothing restarts.
bool ReplicaAgent::restart_whole_job(std::vector<Replica>& replicas, const Error& lost, AgentResult& result) {
  const std::string what = lost.message();
  const bool budget = std::all_of(replicas.begin(), replicas.end(),
                                  [&](const Replica& r) { return r.restarts < options_.agent.max_restarts; });
  if (!budget) {
    DTRAIN_LOG(kError) << what << "; no restarts left to restart the whole job (--max-restarts "
                       << options_.agent.max_restarts << "): stopping the run";
    result.state = AgentState::kFailed;
    result.exit_code = 1;
    result.root_cause_text = what;
    return false;
  }
  DTRAIN_LOG(kError) << what << "; restarting the whole job (every replica group, from its newest checkpoint)";
  for (auto& r : replicas) {
    if (!r.done) r.workers->stop(SIGTERM, options_.agent.stop_grace);
    if (r.store) r.store->stop();
    r.done = false;
  }
  serve_lighthouse();
  for (auto& r : replicas) {
    ++r.restarts;
    start(r);
  }
  ++result.restarts;
  ++result.rounds;
  return true;
}

AgentResult ReplicaAgent::run(const std::atomic<int>& interrupt) {
  AgentResult result;
  serve_lighthouse();
  struct StopOnExit {
    std::vector<Replica>& replicas;
    WorkerStoreHost& lighthouse;
    ~StopOnExit() {
      for (auto& r : replicas) {
        if (r.store) r.store->stop();
      }
      lighthouse.stop();
    }
  };
  std::vector<Replica> replicas(static_cast<std::size_t>(local_replicas()));
  StopOnExit stop_on_exit{replicas, lighthouse_};
  auto stop_all = [&](int signal) {
    for (auto& r : replicas) {
      if (!r.done) r.workers->stop(signal, options_.agent.stop_grace);
    }
  };
  DTRAIN_LOG(kInfo) << local_replicas() << " fault-tolerant replica groups of " << ranks_per_replica() << " rank(s)"
                    << (options_.nodes > 1
                            ? " on node " + std::to_string(options_.node_rank) + " of " +
                                  std::to_string(options_.nodes) + " (" + std::to_string(options_.replicas) + " in all)"
                            : std::string())
                    << "; lighthouse "
                    << (standby_serves_ ? "at the standby " + options_.standby_host + ":" +
                                              std::to_string(options_.standby_port) + ", not "
                        : hosts_lighthouse() ? "on port "
                                             : "at " + options_.lighthouse_host + ":")
                    << lighthouse_port_
                    << (keeps_standby() ? ", standby on port " + std::to_string(options_.standby_port) : std::string());
  for (int i = 0; i < local_replicas(); ++i) {
    replicas[i].id = options_.node_rank * local_replicas() + i;
    replicas[i].workers = make_workers_(replicas[i].id);
    start(replicas[i]);
  }
  ++result.rounds;
  const auto slice = std::max(std::chrono::milliseconds(1), options_.agent.monitor_interval / options_.replicas);
  for (;;) {
    if (const int sig = interrupt.load(); sig != 0) {
      DTRAIN_LOG(kWarning) << "received signal " << sig << "; forwarding it to the workers";
      stop_all(sig);
      result.state = AgentState::kInterrupted;
      result.exit_code = 128 + sig;
      return result;
    }
    try {
      if (has_lighthouse()) lighthouse_.check();
    } catch (const ReplicaStateLostError& e) {
      // Note [Whole-job restart of replica groups].
      if (!hosts_lighthouse()) {
        // The standby's: node 0's launcher, which would restart the whole
        // job, is gone; this node cannot restart its groups.
        DTRAIN_LOG(kError) << e.message() << "; the standby lighthouse cannot restart the whole job: stopping the run";
        stop_all(SIGTERM);
        result.state = AgentState::kFailed;
        result.exit_code = 1;
        result.root_cause_text = e.message();
        return result;
      }
      if (std::any_of(replicas.begin(), replicas.end(), [](const Replica& o) { return o.succeeded; })) {
        // Training is over: the groups left end on their own (their
        // failures are not restarted, as below).
      } else if (!restart_whole_job(replicas, e, result)) {
        stop_all(SIGTERM);
        return result;
      }
    } catch (...) {
      stop_all(SIGTERM);
      throw;
    }
    bool all_done = true;
    for (auto& r : replicas) {
      if (r.done) continue;
      std::optional<WorkerExit> failure;
      const GroupStatus status = r.workers->poll(slice, failure);
      if (status == GroupStatus::kSucceeded) {
        r.done = true;
        r.succeeded = true;
        r.store->stop();
        continue;
      }
      all_done = false;
      if (status != GroupStatus::kFailed) continue;
      result.root_cause = failure;
      const std::string what = "replica group " + std::to_string(r.id) + ": " + failure->describe();
      if (!options_.agent.flight_dump_dir.empty()) {
        result.flight_report =
            collect_flight_report(*r.workers, flight_dump_dir(r.id, r.restarts), options_.agent.flight_dump_wait);
      }
      r.workers->stop(SIGTERM, options_.agent.stop_grace);
      r.store->stop();
      try {
        // A group that failed because the newest state is gone is restarted
        // with all the others, not alone (Note [Whole-job restart of replica groups]).
        if (has_lighthouse()) lighthouse_.check();
      } catch (const ReplicaStateLostError&) {
        all_done = false;
        break;
      }
      if (std::any_of(replicas.begin(), replicas.end(), [](const Replica& o) { return o.succeeded; })) {
        // Training is over (another group finished it): a restart would find
        // no peer to recover from.
        DTRAIN_LOG(kWarning) << what << "; not restarted: another replica group already finished the training";
        r.done = true;
        continue;
      }
      if (r.restarts >= options_.agent.max_restarts) {
        DTRAIN_LOG(kError) << what << "; no restarts left for it (--max-restarts " << options_.agent.max_restarts
                           << "): stopping the run";
        r.done = true;
        stop_all(SIGTERM);
        result.state = AgentState::kFailed;
        result.exit_code = failure->launcher_exit_code();
        result.root_cause_text = what;
        return result;
      }
      ++r.restarts;
      ++result.restarts;
      DTRAIN_LOG(kWarning) << what << "; restarting that replica group only (restart " << r.restarts << " of "
                           << options_.agent.max_restarts << "); the others go on";
      start(r);
    }
    if (all_done) {
      if (serves_lighthouse() && options_.nodes > 1 && options_.linger.count() > 0) {
        DTRAIN_LOG(kInfo) << "this node's replica groups are done; serving the lighthouse "
                          << log::format_seconds(options_.linger) << " longer for the other nodes' groups";
        const auto until = std::chrono::steady_clock::now() + options_.linger;
        while (std::chrono::steady_clock::now() < until && interrupt.load() == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      }
      result.state = AgentState::kSucceeded;
      return result;
    }
  }
}

}  // namespace dtrain::elastic
