// `dtrain run`'s options and their translation into an agent plan.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <string>
#include <vector>

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
  std::string rdzv_conf;  // KEY=VALUE,... (last_call_timeout, heartbeat_interval, heartbeat_timeout)
  std::vector<std::string> program_and_args;
};

void add_launch_options(CLI::App& run, LaunchOptions& options);

// Several nodes: the rendezvous store's endpoint and the protocol's settings.
struct RendezvousPlan {
  bool multi_node = false;
  std::string host;
  int port = 29400;
  elastic::StoreRendezvousOptions options;
};

struct LaunchPlan {
  elastic::AgentOptions agent;
  RendezvousPlan rendezvous;
  std::vector<std::string> argv;  // resolved program first
  std::chrono::milliseconds hang_timeout{0};
  std::string error_file_dir;
};

// Validates the options (ConfigError naming the option) and resolves
// process counts, devices and the program.
LaunchPlan plan_launch(const LaunchOptions& options);

}  // namespace dtrain::tools
