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

// "HOST:PORT" (or "HOST", port 29400 as torchrun), "[v6addr]:PORT" too.
void parse_endpoint(const std::string& text, RendezvousPlan& plan) {
  DTRAIN_CHECK(!text.empty(), ConfigError, "--rdzv-endpoint is empty.", "pass HOST:PORT, e.g. node0:29400");
  std::string host = text;
  std::string port;
  if (text.front() == '[') {
    const auto close = text.find(']');
    DTRAIN_CHECK(close != std::string::npos, ConfigError, "--rdzv-endpoint " << text << " has no closing ']'.",
                 "write [ADDRESS]:PORT for IPv6");
    host = text.substr(1, close - 1);
    if (close + 1 < text.size() && text[close + 1] == ':') port = text.substr(close + 2);
  } else if (const auto colon = text.rfind(':'); colon != std::string::npos) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  DTRAIN_CHECK(!host.empty(), ConfigError, "--rdzv-endpoint " << text << " has no host.", "pass HOST:PORT");
  plan.host = host;
  if (!port.empty()) plan.port = dist::detail::parse_int("--rdzv-endpoint port", port, 1, 65535);
}

// --rdzv-conf last_call_timeout=S,heartbeat_interval=S,heartbeat_timeout=S
void parse_rdzv_conf(const std::string& text, elastic::StoreRendezvousOptions& o) {
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty()) continue;
    const auto eq = item.find('=');
    DTRAIN_CHECK(eq != std::string::npos, ConfigError, "--rdzv-conf item '" << item << "' is not KEY=VALUE.",
                 "e.g. --rdzv-conf last_call_timeout=2,heartbeat_timeout=5");
    const std::string name = item.substr(0, eq);
    double seconds = 0;
    try {
      seconds = std::stod(item.substr(eq + 1));
    } catch (const std::exception&) {
      seconds = -1;
    }
    const std::string option = "--rdzv-conf " + name;
    if (name == "last_call_timeout") {
      o.last_call = seconds == 0 ? std::chrono::milliseconds(0) : seconds_option(option.c_str(), seconds);
    } else if (name == "heartbeat_interval") {
      o.heartbeat_interval = seconds_option(option.c_str(), seconds);
    } else if (name == "heartbeat_timeout") {
      o.heartbeat_timeout = seconds_option(option.c_str(), seconds);
    } else {
      throw ConfigError("--rdzv-conf has unknown key '" + name + "'.",
                        "known keys: last_call_timeout, heartbeat_interval, heartbeat_timeout (seconds)");
    }
  }
  DTRAIN_CHECK(o.heartbeat_timeout > o.heartbeat_interval, ConfigError,
               "--rdzv-conf heartbeat_timeout must exceed heartbeat_interval.", "e.g. interval 0.5, timeout 3");
}

}  // namespace

void add_launch_options(CLI::App& run, LaunchOptions& o) {
  run.prefix_command();  // everything from PROGRAM on belongs to the program
  run.add_option("--nproc-per-node,--nproc_per_node", o.nproc_per_node,
                 "Workers on this node: N, auto (GPUs, else 1), cpu (one per core) or gpu (one per GPU)")
      ->capture_default_str();
  run.add_option("--nnodes", o.nnodes,
                 "Nodes: N, or MIN:MAX for an elastic group (starts with MIN or more; shrinks when a node is "
                 "lost and grows when one joins, without using restarts)")
      ->capture_default_str();
  run.add_option("--node-rank,--node_rank", o.node_rank,
                 "Orders this node among the group's nodes (default: by arrival)");
  run.add_option("--rdzv-endpoint,--rdzv_endpoint", o.rdzv_endpoint,
                 "HOST:PORT of the rendezvous store (c10d TCPStore), hosted by the node whose address it names");
  run.add_option("--rdzv-id,--rdzv_id", o.rdzv_id, "Job id; nodes with another id are refused")->capture_default_str();
  run.add_option("--rdzv-timeout,--rdzv_timeout", o.rdzv_timeout,
                 "Seconds to wait for the rendezvous (for MIN nodes, an unreachable endpoint, ...)")
      ->capture_default_str();
  run.add_option("--rdzv-conf,--rdzv_conf", o.rdzv_conf,
                 "Rendezvous settings KEY=VALUE,... in seconds: last_call_timeout (wait for more nodes once MIN "
                 "joined; default 2), heartbeat_interval (0.5), heartbeat_timeout (node lost after; 3)");
  run.add_flag("--standalone", o.standalone,
               "Single node with an embedded rendezvous on a free port (the default without --rdzv-endpoint)");
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
  DTRAIN_CHECK(!(o.standalone && nodes.max > 1), ConfigError,
               "--standalone runs one node, but --nnodes is " << o.nnodes << ".",
               "drop --standalone and pass --rdzv-endpoint HOST:PORT for several nodes");
  DTRAIN_CHECK(nodes.max == 1 || !o.rdzv_endpoint.empty(), ConfigError,
               "--nnodes " << o.nnodes << " needs a rendezvous endpoint shared by the nodes.",
               "pass --rdzv-endpoint HOST:PORT (the same on every node; HOST is the node that hosts the store)");
  DTRAIN_CHECK(o.node_rank >= -1, ConfigError, "--node-rank " << o.node_rank << " is negative.", "pass 0 or more");
  plan.rendezvous.multi_node = !o.standalone && (!o.rdzv_endpoint.empty() || nodes.max > 1);
  DTRAIN_CHECK(plan.rendezvous.multi_node || o.node_rank <= 0, ConfigError,
               "--node-rank " << o.node_rank << " without a multi-node rendezvous.",
               "drop --node-rank, or pass --rdzv-endpoint and --nnodes");
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
  const auto rdzv_timeout = seconds_option("--rdzv-timeout", o.rdzv_timeout);
  if (plan.rendezvous.multi_node) {
    parse_endpoint(o.rdzv_endpoint, plan.rendezvous);
    auto& r = plan.rendezvous.options;
    r.run_id = o.rdzv_id;
    r.min_nodes = nodes.min;
    r.max_nodes = nodes.max;
    r.nproc = nproc;
    r.node_rank = o.node_rank;
    r.max_restarts = o.max_restarts;
    r.endpoint = plan.rendezvous.host + ":" + std::to_string(plan.rendezvous.port);
    r.timeout = rdzv_timeout;
    parse_rdzv_conf(o.rdzv_conf, r);
  } else {
    DTRAIN_CHECK(o.rdzv_conf.empty(), ConfigError, "--rdzv-conf applies to multi-node rendezvous only.",
                 "drop it, or pass --rdzv-endpoint");
  }

  plan.argv = o.program_and_args;
  plan.argv[0] = elastic::resolve_program(plan.argv[0]);
  plan.error_file_dir =
      (std::filesystem::temp_directory_path() / ("dtrain-run-" + std::to_string(::getpid()))).string();
  return plan;
}

}  // namespace dtrain::tools
