// Parsing and validation of `dtrain run` options.
#include "launch_options.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <thread>

#include "dtrain/comm/device.h"
#include "dtrain/comm/env.h"
#include "dtrain/error.h"

namespace dtrain::tools {
namespace {

std::chrono::milliseconds seconds_option(const char* name, double seconds) {
  DTRAIN_CHECK(std::isfinite(seconds) && seconds > 0, ConfigError, name << " " << seconds << " must be positive.",
               "give seconds, fractions allowed (e.g. 0.5)");
  return std::chrono::milliseconds(std::max<long long>(1, std::llround(seconds * 1000)));
}

struct NodeRange {
  int min = 1;
  int max = 1;
};

NodeRange parse_nnodes(const std::string& text) {
  const auto colon = text.find(':');
  NodeRange r;
  if (colon == std::string::npos) {
    r.min = r.max = dist::detail::parse_int("--nnodes", text, 1, 1 << 16);
  } else {
    r.min = dist::detail::parse_int("--nnodes MIN", text.substr(0, colon), 1, 1 << 16);
    r.max = dist::detail::parse_int("--nnodes MAX", text.substr(colon + 1), 1, 1 << 16);
  }
  DTRAIN_CHECK(r.min <= r.max, ConfigError, "--nnodes " << text << ": MIN " << r.min << " exceeds MAX " << r.max << ".",
               "write MIN:MAX with MIN <= MAX, e.g. 1:2");
  return r;
}

}  // namespace

void add_launch_options(CLI::App& run, LaunchOptions& o) {
  run.prefix_command();  // everything from PROGRAM on belongs to the program
  run.add_option("--nproc-per-node,--nproc_per_node", o.nproc_per_node,
                 "Workers on this node: N, auto (GPUs, else 1), cpu (one per core) or gpu (one per GPU)")
      ->capture_default_str();
  run.add_option("--nnodes", o.nnodes, "Nodes: N, or MIN:MAX for an elastic group")->capture_default_str();
  run.add_option("--node-rank,--node_rank", o.node_rank, "This node's rank (static multi-node groups)");
  run.add_option("--rdzv-endpoint,--rdzv_endpoint", o.rdzv_endpoint, "HOST:PORT of the rendezvous store");
  run.add_option("--rdzv-id,--rdzv_id", o.rdzv_id, "Job id; nodes with another id are refused")->capture_default_str();
  run.add_option("--rdzv-timeout", o.rdzv_timeout, "Seconds to wait for the rendezvous")->capture_default_str();
  run.add_flag("--standalone", o.standalone, "Single node with an embedded rendezvous on a free port (the default)");
  run.add_option("--max-restarts,--max_restarts", o.max_restarts, "Restarts of the worker group after failures")
      ->capture_default_str();
  run.add_option("--monitor-interval,--monitor_interval", o.monitor_interval, "Seconds between worker checks")
      ->capture_default_str();
  run.add_option("--log-dir,--log_dir", o.log_dir, "Write each rank's output to LOG_DIR/attempt_N/rank_R.log");
  run.add_flag("--tee", o.tee, "Also print each output line, prefixed with its rank");
  run.add_option("--devices", o.devices,
                 "Devices for the workers (cpu, cuda, 0,2, ...): sets CUDA_VISIBLE_DEVICES and, unless "
                 "--nproc-per-node is given, one worker per device");
  run.add_option("--hang-timeout", o.hang_timeout, "Seconds a stopped worker may stay stopped before it counts as hung")
      ->capture_default_str();
  run.add_option("--stop-grace", o.stop_grace, "Seconds between forwarding a signal and SIGKILL")
      ->capture_default_str();
}

LaunchPlan plan_launch(const LaunchOptions& o) {
  LaunchPlan plan;
  const NodeRange nodes = parse_nnodes(o.nnodes);
  DTRAIN_CHECK(nodes.max == 1, ConfigError,
               "--nnodes " << o.nnodes << ": multi-node groups are not implemented yet; this dtrain launches one node.",
               "run with --nnodes 1 (the default), or use torchrun for several nodes for now");
  DTRAIN_CHECK(o.rdzv_endpoint.empty() || o.standalone, ConfigError,
               "--rdzv-endpoint is for multi-node groups, which this dtrain does not launch yet.",
               "drop --rdzv-endpoint for a single node");
  DTRAIN_CHECK(o.node_rank == 0, ConfigError, "--node-rank " << o.node_rank << " is not 0 on a single node.",
               "drop --node-rank");
  DTRAIN_CHECK(o.max_restarts >= 0, ConfigError, "--max-restarts " << o.max_restarts << " is negative.",
               "pass 0 or more");
  DTRAIN_CHECK(!o.program_and_args.empty(), ConfigError, "no program to run was given.",
               "dtrain run [options] PROGRAM [ARGS...]");

  const auto inventory = DeviceInventory::current();
  int nproc = 0;
  if (o.nproc_per_node == "auto") {
    nproc = inventory.cuda_count > 0 ? inventory.cuda_count : 1;
  } else if (o.nproc_per_node == "cpu") {
    nproc = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  } else if (o.nproc_per_node == "gpu") {
    DTRAIN_CHECK(inventory.cuda_count > 0, ConfigError, "--nproc-per-node gpu, but no GPU is visible.",
                 "use a number, cpu or auto, or run where a GPU is visible");
    nproc = inventory.cuda_count;
  } else {
    nproc = dist::detail::parse_int("--nproc-per-node", o.nproc_per_node, 1, 4096);
  }
  if (!o.devices.empty()) {
    const auto devices = parse_devices(o.devices, inventory);
    const bool cuda = devices.front().is_cuda();
    std::string visible;
    std::vector<std::string> physical;
    if (inventory.cuda_visible_devices) {
      std::stringstream in(*inventory.cuda_visible_devices);
      std::string item;
      while (std::getline(in, item, ',')) physical.push_back(item);
    }
    for (const auto& d : devices) {
      if (!d.is_cuda()) continue;
      const auto index = static_cast<size_t>(d.index());
      visible += (visible.empty() ? "" : ",") + (index < physical.size() ? physical[index] : std::to_string(index));
    }
    plan.agent.extra_env["CUDA_VISIBLE_DEVICES"] = cuda ? visible : "";
    // --nproc-per-node left at its default of 1: one worker per listed device.
    if (o.nproc_per_node == "1") nproc = static_cast<int>(devices.size());
  }
  plan.agent.nproc_per_node = nproc;
  plan.agent.max_restarts = o.max_restarts;
  plan.agent.monitor_interval = seconds_option("--monitor-interval", o.monitor_interval);
  plan.agent.stop_grace = seconds_option("--stop-grace", o.stop_grace);
  plan.agent.run_id = o.rdzv_id;
  plan.hang_timeout = seconds_option("--hang-timeout", o.hang_timeout);
  (void)seconds_option("--rdzv-timeout", o.rdzv_timeout);

  plan.argv = o.program_and_args;
  plan.argv[0] = elastic::resolve_program(plan.argv[0]);
  plan.error_file_dir =
      (std::filesystem::temp_directory_path() / ("dtrain-run-" + std::to_string(::getpid()))).string();
  return plan;
}

}  // namespace dtrain::tools
