// The launcher's agent: an explicit state machine over a WorkerGroup and a
// Rendezvous.
//
//   kInit -> kRendezvous -> kRunning -> kSucceeded        all workers exited 0
//                              |    -> kFailed           a worker failed (here or on another
//                              |                         node) and no restarts are left
//                              |    -> kInterrupted      SIGINT/SIGTERM to the launcher
//                              +--> kRestarting -> kRendezvous   the round ended: a worker
//                                                    failed or hung with restarts left, or
//                                                    membership changed (a node was lost or
//                                                    joined: no restart used); stop the
//                                                    workers, start a new round
//
// Each round gets a fresh MASTER_PORT, on which the agent of node rank 0
// hosts the workers' store for that round (WorkerStoreHost); every worker is
// told so with TORCHELASTIC_USE_AGENT_STORE=True and only connects. See Note
// [Worker store] in src/elastic/agent.cpp.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "dtrain/elastic/rendezvous.h"
#include "dtrain/elastic/worker_group.h"
#include "dtrain/elastic/worker_store.h"

namespace dtrain::elastic {

enum class AgentState { kInit, kRendezvous, kRunning, kRestarting, kSucceeded, kFailed, kInterrupted };
std::string to_string(AgentState state);

struct AgentOptions {
  int nproc_per_node = 1;
  int max_restarts = 0;
  std::chrono::milliseconds monitor_interval{100};
  std::chrono::milliseconds stop_grace{5000};  // between the forwarded signal and SIGKILL
  std::string run_id = "none";
  std::string role = "default";  // ROLE_NAME (torchrun's --role)
  std::string master_addr = "127.0.0.1";
  std::map<std::string, std::string> extra_env;  // e.g. CUDA_VISIBLE_DEVICES from --devices
  int master_port = 0;                           // 0: a free port each round
  // Where workers dump their flight recorders (DTRAIN_FLIGHT_RECORDER_DIR,
  // one attempt_N folder per round); "" when the recorder is off. When a
  // round fails, the agent asks live workers to dump (SIGUSR1), waits up to
  // `flight_dump_wait` for them, and reports which rank kept the others
  // waiting (AgentResult::flight_report; see flight_analysis.h).
  std::string flight_dump_dir;
  std::chrono::milliseconds flight_dump_wait{3000};
};

struct AgentResult {
  AgentState state = AgentState::kInit;
  int exit_code = 0;
  int restarts = 0;                      // rounds restarted after failures
  int rounds = 0;                        // rounds started (restarts and membership changes)
  std::optional<WorkerExit> root_cause;  // this node's failure that ended the run, or the last one
  std::string root_cause_text;           // the failure that ended the run (maybe another node's)
  std::string flight_report;             // the last failed round's flight-recorder analysis, if any
};

class Agent {
 public:
  // One node: a StandaloneRendezvous from the options. `store_host` serves
  // the workers' store whenever this node is node rank 0; not owned.
  Agent(AgentOptions options, WorkerGroup& workers, WorkerStoreHost& store_host);
  // Any rendezvous (several nodes: a StoreRendezvous); not owned.
  Agent(AgentOptions options, WorkerGroup& workers, WorkerStoreHost& store_host, Rendezvous& rendezvous);
  // Runs to completion. `interrupt` is polled every monitor interval; a
  // non-zero value is a signal number to forward to the workers.
  AgentResult run(const std::atomic<int>& interrupt);
  AgentState state() const { return state_; }
  // Called on every transition (logging, tests).
  std::function<void(AgentState from, AgentState to)> on_transition;
  // The environment worker `local_rank` gets in the round `plan` describes.
  std::map<std::string, std::string> worker_env(int local_rank, const RoundPlan& plan) const;

 private:
  void move_to(AgentState next);
  void check_options() const;
  AgentOptions options_;
  WorkerGroup& workers_;
  WorkerStoreHost& store_host_;
  std::unique_ptr<Rendezvous> owned_rendezvous_;
  Rendezvous* rendezvous_;
  AgentState state_ = AgentState::kInit;
};

}  // namespace dtrain::elastic
