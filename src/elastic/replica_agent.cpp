// The launcher's agent for fault-tolerant replica groups
// (include/dtrain/elastic/replica_agent.h).
#include "dtrain/elastic/replica_agent.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
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
  DTRAIN_CHECK(options_.agent.nproc_per_node % options_.replicas == 0, ConfigError,
               "--nproc-per-node " << options_.agent.nproc_per_node << " does not split into --ft-replicas "
                                   << options_.replicas << " equal replica groups.",
               "make --nproc-per-node a multiple of --ft-replicas");
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
  env["DTRAIN_FT_LIGHTHOUSE"] = options_.agent.master_addr + ":" + std::to_string(lighthouse_port_);
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

AgentResult ReplicaAgent::run(const std::atomic<int>& interrupt) {
  AgentResult result;
  lighthouse_port_ = options_.lighthouse_port;
  lighthouse_.serve(net::listen_tcp(lighthouse_port_), lighthouse_port_);
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
  std::vector<Replica> replicas(static_cast<std::size_t>(options_.replicas));
  StopOnExit stop_on_exit{replicas, lighthouse_};
  auto stop_all = [&](int signal) {
    for (auto& r : replicas) {
      if (!r.done) r.workers->stop(signal, options_.agent.stop_grace);
    }
  };
  DTRAIN_LOG(kInfo) << options_.replicas << " fault-tolerant replica groups of " << ranks_per_replica()
                    << " rank(s); lighthouse on port " << lighthouse_port_;
  for (int i = 0; i < options_.replicas; ++i) {
    replicas[i].id = i;
    replicas[i].workers = make_workers_(i);
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
      lighthouse_.check();
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
      result.state = AgentState::kSucceeded;
      return result;
    }
  }
}

}  // namespace dtrain::elastic
