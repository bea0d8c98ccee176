// `dtrain run`'s options and their translation into an agent plan.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "dtrain/comm/env.h"
#include "dtrain/elastic/agent.h"

namespace dtrain::tools {

struct LaunchOptions {
  std::string nproc_per_node = "1";  // N, auto, cpu or gpu
  std::string nnodes = "1";          // N or MIN:MAX
  int node_rank = -1;                // -1: by arrival
  std::string rdzv_endpoint;
  std::string rdzv_id = "none";
  double rdzv_timeout = 900;
  bool standalone = false;
  int max_restarts = 0;
  double monitor_interval = 0.1;
  std::string log_dir;
  bool tee = false;
  std::string devices;
  double hang_timeout = 30;
  double stop_grace = 5;
  std::string rdzv_conf;         // KEY=VALUE,... (last_call_timeout, heartbeat_interval, heartbeat_timeout)
  std::string rdzv_secret_file;  // else DTRAIN_RDZV_SECRET; see Note [Rendezvous authentication]
  // Fault-tolerant replica groups (docs/fault_tolerance.md); 0: off.
  int ft_replicas = 0;
  int ft_min_replicas = 1;
  double ft_heartbeat_timeout = 2;
  double ft_join_timeout = 10;
  int ft_lighthouse_port = 0;
  std::string ft_lighthouse_standby;  // HOST:PORT on node 1 (Note [Lighthouse failover]); "": none
  double ft_failover_timeout = 10;
  // torchrun's (tools/dtrain/torchrun_args.h rewrites its spellings and PET_* variables):
  std::string rdzv_backend;  // "": c10d with --rdzv-endpoint, static with --master-addr/--master-port
  std::string master_addr;   // static backend; "" unset (127.0.0.1)
  int master_port = -1;      // static backend; -1 unset (29500)
  std::string local_addr;    // this node's address as other nodes reach it
  std::string role = "default";
  std::string redirects;     // torchrun's 0..3 or LOCAL_RANK:N,...
  std::string tee_streams;   // torchrun's --tee VALUE
  std::string start_method;  // spawn only
  std::string event_log_handler;
  double shutdown_timeout = -1;  // seconds; torchrun's name for --stop-grace
  bool no_python = false;
  bool module = false;
  bool run_path = false;
  std::map<std::string, std::string> unsupported;  // torchrun option -> value given
  std::vector<std::string> program_and_args;
};

void add_launch_options(CLI::App& run, LaunchOptions& options);

// Several nodes: the rendezvous store's endpoint and the protocol's settings.
struct RendezvousPlan {
  bool multi_node = false;
  std::string host;
  int port = 29400;
  std::string local_addr;  // "": the address that routes to `host`
  std::string secret;      // "": joins are not authenticated
  elastic::StoreRendezvousOptions options;
};

// --ft-replicas: the node's workers as replica groups under a lighthouse.
struct FaultTolerancePlan {
  int replicas = 0;  // 0: off; the groups of all nodes
  int lighthouse_port = 0;
  std::string lighthouse_config;  // for src/ft/lighthouse_host.cpp
  // Several nodes (a fixed count): this node's rank, and the lighthouse's
  // host (node 0, at the rendezvous endpoint; its port is lighthouse_port).
  int nodes = 1;
  int node_rank = 0;
  std::string lighthouse_host;
  std::chrono::milliseconds linger{0};  // node 0 serves on this long after its own groups finished
  // --ft-lighthouse-standby: node 1's standby lighthouse (empty host: none).
  std::string standby_host;
  int standby_port = 0;
};

struct LaunchPlan {
  elastic::AgentOptions agent;
  FaultTolerancePlan fault_tolerance;
  RendezvousPlan rendezvous;
  std::vector<std::string> argv;  // resolved program first
  std::chrono::milliseconds hang_timeout{0};
  std::string error_file_dir;
  std::string log_dir;  // --log-dir (torchrun's --redirects/--tee resolved)
  bool tee = false;
};

// Validates the options (ConfigError naming the option, and saying why for a
// torchrun option dtrain refuses) and resolves process counts, devices, the
// rendezvous and the program. Started once per node by srun or mpirun with no
// node layout given (--nnodes, --node-rank, --rdzv-endpoint, --master-addr,
// --master-port, --standalone, --rdzv-backend), the nodes come from that
// launcher's variables (cluster_env.h).
LaunchPlan plan_launch(const LaunchOptions& options, const dist::EnvLookup& env = dist::process_env());

}  // namespace dtrain::tools
