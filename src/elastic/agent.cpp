// The launcher agent's state machine.
//
// Note [Worker store]
// Workers meet through a c10d store on MASTER_ADDR:MASTER_PORT. The agent of
// node rank 0 hosts it (WorkerStoreHost) and every worker gets
// TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun, so all ranks only
// connect: torch's env:// rendezvous, dtrain's init_process_group and any
// program on plain c10d that honours the variable work unchanged. (Before,
// the agent handed its pre-bound socket to rank 0, which only dtrain's own
// workers knew to take over; a plain PyTorch rank 0 failed with EADDRINUSE.)
// - One store per round, on the round's fresh port, not one for the job as
//   torchrun keeps: programs that know nothing of the launcher key their
//   groups the same way in every attempt (torch: "default_pg/0/..."), so a
//   store kept across a restart still holds the dead attempt's keys, and a
//   restarted rank that starts before its peer reads gloo addresses of dead
//   processes (a plain gloo program then timed out in connectFullMesh after
//   100 s, with one store kept across two attempts). A fresh store rules
//   that out, and node rank 0 may be another node in the next round anyway.
//   Starting a server costs milliseconds once libdtrain is loaded.
// - Start time: the port is bound and listening before any worker starts,
//   so workers' connections queue on it while the store starts; the
//   launcher (no LibTorch) loads libdtrain for it on a background thread
//   while the workers start (tools/dtrain/libdtrain_loader.cpp). The
//   listening socket also keeps any other process off the port.
#include "dtrain/elastic/agent.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "flight_dumps.h"

namespace dtrain::elastic {

std::string to_string(AgentState state) {
  switch (state) {
    case AgentState::kInit: return "init";
    case AgentState::kRendezvous: return "rendezvous";
    case AgentState::kRunning: return "running";
    case AgentState::kRestarting: return "restarting";
    case AgentState::kSucceeded: return "succeeded";
    case AgentState::kFailed: return "failed";
    case AgentState::kInterrupted: return "interrupted";
  }
  return "?";
}

Agent::Agent(AgentOptions options, WorkerGroup& workers, WorkerStoreHost& store_host)
    : options_(std::move(options)),
      workers_(workers),
      store_host_(store_host),
      owned_rendezvous_(std::make_unique<StandaloneRendezvous>(options_.nproc_per_node, options_.max_restarts,
                                                               options_.master_addr, options_.master_port)),
      rendezvous_(owned_rendezvous_.get()) {
  check_options();
}

Agent::Agent(AgentOptions options, WorkerGroup& workers, WorkerStoreHost& store_host, Rendezvous& rendezvous)
    : options_(std::move(options)), workers_(workers), store_host_(store_host), rendezvous_(&rendezvous) {
  check_options();
}

void Agent::check_options() const {
  DTRAIN_CHECK(options_.nproc_per_node >= 1, ConfigError,
               "--nproc-per-node " << options_.nproc_per_node << " must be at least 1.", "pass N >= 1");
  DTRAIN_CHECK(options_.max_restarts >= 0, ConfigError, "--max-restarts " << options_.max_restarts << " is negative.",
               "pass 0 or more");
}

void Agent::move_to(AgentState next) {
  const AgentState from = state_;
  state_ = next;
  if (on_transition) on_transition(from, next);
}

std::map<std::string, std::string> Agent::worker_env(int local_rank, const RoundPlan& plan) const {
  std::map<std::string, std::string> env = options_.extra_env;
  const auto contract = dist::to_environment({.rank = plan.rank_base + local_rank,
                                              .world_size = plan.world_size,
                                              .local_rank = local_rank,
                                              .local_world_size = options_.nproc_per_node,
                                              .master_addr = plan.master_addr,
                                              .master_port = plan.master_port,
                                              // node rank 0's agent hosts it: Note [Worker store]
                                              .agent_store = true,
                                              .restart_count = plan.restart_count,
                                              .group_rank = plan.node_rank,
                                              .max_restarts = options_.max_restarts,
                                              .run_id = options_.run_id,
                                              .role = options_.role});
  for (const auto& [name, value] : contract) env[name] = value;
  env["DTRAIN_RDZV_ROUND"] = std::to_string(plan.round);
  if (!options_.flight_dump_dir.empty())
    env["DTRAIN_FLIGHT_RECORDER_DIR"] = flight_dump_dir(options_.flight_dump_dir, plan);
  if (std::getenv("OMP_NUM_THREADS") == nullptr) env["OMP_NUM_THREADS"] = "1";
  return env;
}

AgentResult Agent::run(const std::atomic<int>& interrupt) {
  struct StopStoreOnExit {
    WorkerStoreHost& host;
    ~StopStoreOnExit() { host.stop(); }
  } stop_store{store_host_};
  AgentResult result;
  auto finish = [&](AgentState state, int exit_code) {
    move_to(state);
    result.state = state;
    result.exit_code = exit_code;
    return result;
  };
  for (;;) {
    move_to(AgentState::kRendezvous);
    const RoundPlan plan = rendezvous_->next_round();
    result.restarts = plan.restart_count;
    ++result.rounds;
    std::vector<WorkerLaunch> launches;
    launches.reserve(static_cast<std::size_t>(options_.nproc_per_node));
    for (int r = 0; r < options_.nproc_per_node; ++r) {
      launches.push_back({.local_rank = r, .global_rank = plan.rank_base + r, .env = worker_env(r, plan)});
    }
    // Node rank 0: the store starts (in the background) before the workers do.
    if (plan.master_listen_fd >= 0) store_host_.serve(plan.master_listen_fd, plan.master_port);
    workers_.start(launches, plan.round);
    move_to(AgentState::kRunning);
    std::optional<WorkerExit> failure;
    std::optional<RoundEnding> ending;
    GroupStatus status = GroupStatus::kRunning;
    while (status == GroupStatus::kRunning && !ending) {
      if (const int sig = interrupt.load(); sig != 0) {
        DTRAIN_LOG(kWarning) << "received "
                             << (sig == SIGINT    ? "SIGINT"
                                 : sig == SIGTERM ? "SIGTERM"
                                                  : "a signal")
                             << "; forwarding it to the workers";
        workers_.stop(sig, options_.stop_grace);
        return finish(AgentState::kInterrupted, 128 + sig);
      }
      status = workers_.poll(options_.monitor_interval, failure);
      if (status == GroupStatus::kRunning) {
        try {
          store_host_.check();
          ending = rendezvous_->poll();
        } catch (...) {  // e.g. a store went away or never started: no orphans, then report
          workers_.stop(SIGTERM, options_.stop_grace);
          throw;
        }
      }
    }
    if (status == GroupStatus::kSucceeded) {
      rendezvous_->finish();
      return finish(AgentState::kSucceeded, 0);
    }
    if (!ending) {
      result.root_cause = failure;
      ending = rendezvous_->report_failure(*failure);
    }
    if (!options_.flight_dump_dir.empty() && ending->kind == RoundEnding::Kind::kFailure) {
      result.flight_report =
          collect_flight_report(workers_, flight_dump_dir(options_.flight_dump_dir, plan), options_.flight_dump_wait);
    }
    workers_.stop(SIGTERM, options_.stop_grace);
    store_host_.stop();  // the next round has its own: Note [Worker store]
    if (ending->kind == RoundEnding::Kind::kFailure) result.root_cause_text = ending->reason;
    if (ending->give_up) {
      result.restarts = plan.restart_count;
      rendezvous_->finish();
      return finish(AgentState::kFailed, ending->exit_code);
    }
    if (ending->kind == RoundEnding::Kind::kFailure) {
      DTRAIN_LOG(kWarning) << ending->reason << "; restarting the workers (restart " << plan.restart_count + 1 << " of "
                           << options_.max_restarts << ")";
    } else {
      DTRAIN_LOG(kWarning) << "membership changed: " << ending->reason << "; re-forming the group (no restart used)";
    }
    move_to(AgentState::kRestarting);
  }
}

}  // namespace dtrain::elastic
