// Parsing and validation of `dtrain run` options.
#include "launch_options.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <thread>

#include "dtrain/comm/cluster_env.h"
#include "dtrain/comm/device.h"
#include "dtrain/comm/env.h"
#include "dtrain/comm/flight_recorder.h"
#include "dtrain/error.h"
#include "dtrain/ft/lighthouse_address.h"
#include "dtrain/log.h"
#include "torchrun_args.h"

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
  bool keep_alive_interval = false;
  bool heartbeat_timeout_given = false;
  double keep_alive_attempts = 3;  // torchrun's default
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
    if (name == "failover_quorum") {
      const std::string value = item.substr(eq + 1);
      DTRAIN_CHECK(value == "min" || value == "majority", ConfigError,
                   "--rdzv-conf failover_quorum=" << value << " is not min or majority.",
                   "majority (default: no split brain) or min (go on with MIN nodes after losing the store host)");
      o.failover_quorum_min = value == "min";
    } else if (name == "join_timeout" || name == "timeout") {  // torchrun's names for --rdzv-timeout
      o.timeout = seconds_option(option.c_str(), seconds);
    } else if (name == "keep_alive_interval") {  // torchrun's heartbeat_interval
      o.heartbeat_interval = seconds_option(option.c_str(), seconds);
      keep_alive_interval = true;
    } else if (name == "keep_alive_max_attempt") {  // torchrun: lost after interval * attempts
      keep_alive_attempts = seconds;
    } else if (name == "last_call_timeout") {
      o.last_call = seconds == 0 ? std::chrono::milliseconds(0) : seconds_option(option.c_str(), seconds);
    } else if (name == "heartbeat_interval") {
      o.heartbeat_interval = seconds_option(option.c_str(), seconds);
    } else if (name == "heartbeat_timeout") {
      o.heartbeat_timeout = seconds_option(option.c_str(), seconds);
      heartbeat_timeout_given = true;
    } else {
      throw ConfigError(
          "--rdzv-conf has unknown key '" + name + "'.",
          "known keys (seconds): last_call_timeout, heartbeat_interval, heartbeat_timeout; failover_quorum "
          "(majority|min); and "
          "torchrun's join_timeout, timeout, keep_alive_interval, keep_alive_max_attempt; torchrun's "
          "close_timeout, read_timeout, is_host and store_type have no counterpart in dtrain");
    }
  }
  if (keep_alive_interval && !heartbeat_timeout_given) {
    DTRAIN_CHECK(keep_alive_attempts >= 1, ConfigError, "--rdzv-conf keep_alive_max_attempt must be at least 1.",
                 "e.g. keep_alive_max_attempt=3");
    o.heartbeat_timeout = std::chrono::milliseconds(
        std::llround(static_cast<double>(o.heartbeat_interval.count()) * keep_alive_attempts));
  }
  DTRAIN_CHECK(o.heartbeat_timeout > o.heartbeat_interval, ConfigError,
               "--rdzv-conf heartbeat_timeout must exceed heartbeat_interval.", "e.g. interval 0.5, timeout 3");
}

}  // namespace

void add_launch_options(CLI::App& run, LaunchOptions& o) {
  run.prefix_command();  // everything from PROGRAM on belongs to the program
  add_torchrun_options(run, o);
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
  run.add_option("--rdzv-secret-file,--rdzv_secret_file", o.rdzv_secret_file,
                 "File holding the job's shared secret (else DTRAIN_RDZV_SECRET): every node proves it knows it "
                 "(challenge-response) before it may use the rendezvous store; others are refused");
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
  run.add_option("--ft-replicas", o.ft_replicas,
                 "Fault-tolerant replica groups: split the workers into N groups under a lighthouse; a failure "
                 "restarts its group only, which recovers live from the others (docs/fault_tolerance.md)")
      ->capture_default_str();
  run.add_option("--ft-min-replicas", o.ft_min_replicas, "Replica groups a step needs at least")->capture_default_str();
  run.add_option("--ft-heartbeat-timeout", o.ft_heartbeat_timeout,
                 "Seconds without a heartbeat after which a replica group is dropped from the quorum")
      ->capture_default_str();
  run.add_option("--ft-join-timeout", o.ft_join_timeout,
                 "Seconds a quorum waits for live replica groups that have not asked for it yet")
      ->capture_default_str();
  run.add_option("--ft-lighthouse-port", o.ft_lighthouse_port, "The lighthouse's port (0: a free one)")
      ->capture_default_str();
  run.add_option("--ft-lighthouse-standby", o.ft_lighthouse_standby,
                 "HOST:PORT of node 1, given on every node: node 1 keeps a standby lighthouse there that serves "
                 "once node 0's has been silent for --ft-failover-timeout, so node 0's loss stops only its groups");
  run.add_option("--ft-failover-timeout", o.ft_failover_timeout,
                 "Seconds node 0's lighthouse may be silent before the standby (--ft-lighthouse-standby) serves")
      ->capture_default_str();
}

namespace {
// Nothing on the command line or in PET_* says how the nodes meet.
bool layout_given(const LaunchOptions& o) {
  return o.nnodes != "1" || o.node_rank >= 0 || !o.rdzv_endpoint.empty() || !o.master_addr.empty() ||
         o.master_port >= 0 || o.standalone || !o.rdzv_backend.empty();
}

// srun or mpirun started one `dtrain run` per node: its tasks are the nodes.
void apply_cluster_layout(LaunchOptions& o, const dist::EnvLookup& env) {
  if (layout_given(o) || !dist::detail::cluster_launcher_present(env)) return;
  const auto task = dist::read_cluster_task(env);
  if (!task || task->world_size == 1) return;
  DTRAIN_CHECK(task->local_world_size == 1, ConfigError,
               to_string(task->source) << " started " << task->local_world_size
                                       << " copies of dtrain run on this node; it starts one per node.",
               "start one launcher per node (srun --ntasks-per-node=1, mpirun --map-by ppr:1:node) and give the "
               "workers per node with --nproc-per-node, or run PROGRAM itself under srun/mpirun without dtrain run");
  o.nnodes = std::to_string(task->world_size);
  o.node_rank = task->rank;
  o.rdzv_endpoint = task->master_addr + ":" + std::to_string(task->master_port);
  if (o.rdzv_id == "none" && !task->job_id.empty()) o.rdzv_id = task->job_id;
  DTRAIN_LOG(kInfo) << "environment: " << to_string(task->source) << " (" << task->origin << "): node " << task->rank
                    << " of " << task->world_size << ", rendezvous at " << o.rdzv_endpoint;
}

// torchrun's two backends over dtrain's one store rendezvous: c10d is it;
// static is it with a fixed node count, node ranks from --node-rank (0 by
// default, as torchrun) and the store at --master-addr:--master-port.
void resolve_backend(LaunchOptions& o, const NodeRange& nodes, elastic::AgentOptions& agent) {
  const bool master_given = !o.master_addr.empty() || o.master_port >= 0;
  std::string backend = o.rdzv_backend;
  if (backend.empty()) backend = !o.rdzv_endpoint.empty() || !master_given ? "c10d" : "static";
  DTRAIN_CHECK(backend != "etcd" && backend != "etcd-v2", ConfigError,
               "--rdzv-backend " << backend << " is not supported: dtrain's rendezvous runs over c10d's TCPStore, "
                                 << "hosted by the node that --rdzv-endpoint names.",
               "use --rdzv-backend c10d --rdzv-endpoint HOST:PORT (or static with --master-addr/--master-port)");
  DTRAIN_CHECK(backend == "c10d" || backend == "static", ConfigError, "--rdzv-backend " << backend << " is unknown.",
               "use c10d or static");
  DTRAIN_CHECK(o.master_port == -1 || (o.master_port >= 1 && o.master_port <= 65535), ConfigError,
               "--master-port " << o.master_port << " is out of range.", "pass a port in 1..65535");
  if (o.standalone) return;  // as torchrun: the backend settings give way
  if (backend == "c10d") {
    if (master_given) {
      DTRAIN_LOG(kWarning) << "--master-addr/--master-port are used by the static backend only (as in torchrun); "
                              "ignored with c10d, whose store is at --rdzv-endpoint";
    }
    return;
  }
  DTRAIN_CHECK(nodes.min == nodes.max, ConfigError,
               "--rdzv-backend static needs a fixed node count, but --nnodes is " << o.nnodes << ".",
               "pass --nnodes N, or use --rdzv-backend c10d for MIN:MAX");
  const std::string addr = o.master_addr.empty() ? "127.0.0.1" : o.master_addr;
  const int port = o.master_port >= 0 ? o.master_port : 29500;
  if (nodes.max == 1 && o.rdzv_endpoint.empty()) {
    // One node: torchrun's workers meet at --master-addr:--master-port, where its agent hosts the store.
    if (o.master_port >= 0) {
      agent.master_addr = addr;
      agent.master_port = port;
    }
    return;
  }
  if (o.rdzv_endpoint.empty()) {
    o.rdzv_endpoint = (addr.find(':') != std::string::npos && addr.front() != '[' ? "[" + addr + "]" : addr) + ":" +
                      std::to_string(port);
  }
  if (o.node_rank < 0) o.node_rank = 0;
}
}  // namespace

LaunchPlan plan_launch(const LaunchOptions& given, const dist::EnvLookup& env) {
  LaunchOptions o = given;
  apply_torchrun_options(o);
  apply_cluster_layout(o, env);
  LaunchPlan plan;
  const NodeRange nodes = parse_nnodes(o.nnodes);
  resolve_backend(o, nodes, plan.agent);
  DTRAIN_CHECK(!(o.standalone && nodes.max > 1), ConfigError,
               "--standalone runs one node, but --nnodes is " << o.nnodes << ".",
               "drop --standalone and pass --rdzv-endpoint HOST:PORT for several nodes");
  DTRAIN_CHECK(nodes.max == 1 || !o.rdzv_endpoint.empty(), ConfigError,
               "--nnodes " << o.nnodes << " needs a rendezvous endpoint shared by the nodes.",
               "pass --rdzv-endpoint HOST:PORT (the same on every node; HOST is the node that hosts the store), or "
               "--master-addr HOST --master-port PORT with --node-rank (static)");
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
      const int index = d.index();  // NOLINT(bugprone-signed-char-misuse): DeviceIndex is an int8_t number
      const bool known = index >= 0 && static_cast<std::size_t>(index) < physical.size();
      visible +=
          (visible.empty() ? "" : ",") + (known ? physical[static_cast<std::size_t>(index)] : std::to_string(index));
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
  plan.agent.role = o.role;
  plan.hang_timeout = seconds_option("--hang-timeout", o.hang_timeout);
  const auto rdzv_timeout = seconds_option("--rdzv-timeout", o.rdzv_timeout);
  if (plan.rendezvous.multi_node) {
    parse_endpoint(o.rdzv_endpoint, plan.rendezvous);
    plan.rendezvous.local_addr = o.local_addr;
    plan.rendezvous.secret = elastic::auth::read_secret(o.rdzv_secret_file);
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
    DTRAIN_CHECK(o.rdzv_secret_file.empty(), ConfigError, "--rdzv-secret-file applies to multi-node rendezvous only.",
                 "drop it, or pass --rdzv-endpoint");
  }

  if (o.ft_replicas != 0) {
    DTRAIN_CHECK(o.ft_replicas >= 1, ConfigError, "--ft-replicas " << o.ft_replicas << " is negative.",
                 "pass the number of replica groups, e.g. --ft-replicas 4");
    // Several nodes: a fixed count, each with its --node-rank; --ft-replicas
    // counts the groups of all of them, nnodes of them equal shares
    // (docs/fault_tolerance.md, "Several nodes").
    const int ft_nodes = plan.rendezvous.multi_node ? nodes.max : 1;
    DTRAIN_CHECK(!plan.rendezvous.multi_node || (nodes.min == nodes.max && o.node_rank >= 0), ConfigError,
                 "--ft-replicas over several nodes needs a fixed node count and each node's --node-rank (got --nnodes "
                     << o.nnodes << (o.node_rank >= 0 ? "" : ", no --node-rank") << ").",
                 "pass --nnodes N --node-rank I on every node; node 0 hosts the lighthouse at the rendezvous "
                 "endpoint");
    DTRAIN_CHECK(o.node_rank < ft_nodes, ConfigError,
                 "--node-rank " << o.node_rank << " is not below --nnodes " << ft_nodes << ".", "number nodes 0..N-1");
    DTRAIN_CHECK(o.ft_replicas % ft_nodes == 0, ConfigError,
                 "--ft-replicas " << o.ft_replicas << " does not split into --nnodes " << ft_nodes
                                  << " equal shares of replica groups.",
                 "make --ft-replicas (the groups of all nodes) a multiple of --nnodes");
    const int local_replicas = o.ft_replicas / ft_nodes;
    DTRAIN_CHECK(
        nproc % local_replicas == 0, ConfigError,
        "--nproc-per-node " << nproc << " does not split into --ft-replicas " << o.ft_replicas
                            << (ft_nodes > 1 ? " / --nnodes " + std::to_string(ft_nodes) : std::string())
                            << " equal replica groups.",
        "make --nproc-per-node a multiple of --ft-replicas" << (ft_nodes > 1 ? " / --nnodes (the node's groups)" : ""));
    DTRAIN_CHECK(o.ft_min_replicas >= 1 && o.ft_min_replicas <= o.ft_replicas, ConfigError,
                 "--ft-min-replicas " << o.ft_min_replicas << " is not in 1..--ft-replicas " << o.ft_replicas << ".",
                 "pass 1 (go on with any survivor) up to the number of replica groups");
    DTRAIN_CHECK(o.ft_lighthouse_port >= 0 && o.ft_lighthouse_port <= 65535, ConfigError,
                 "--ft-lighthouse-port " << o.ft_lighthouse_port << " is not a port.",
                 "pass 0 (a free one) or 1..65535");
    plan.fault_tolerance.replicas = o.ft_replicas;
    plan.fault_tolerance.lighthouse_port = o.ft_lighthouse_port;
    if (ft_nodes > 1) {
      plan.fault_tolerance.nodes = ft_nodes;
      plan.fault_tolerance.node_rank = o.node_rank;
      plan.fault_tolerance.lighthouse_host = plan.rendezvous.host;
      if (o.ft_lighthouse_port == 0) plan.fault_tolerance.lighthouse_port = plan.rendezvous.port;
      plan.fault_tolerance.linger = seconds_option("--ft-heartbeat-timeout", o.ft_heartbeat_timeout) * 2;
    }
    plan.fault_tolerance.lighthouse_config =
        "min_replicas=" + std::to_string(o.ft_min_replicas) + ",startup_replicas=" + std::to_string(o.ft_replicas) +
        ",heartbeat_timeout_ms=" +
        std::to_string(seconds_option("--ft-heartbeat-timeout", o.ft_heartbeat_timeout).count()) +
        ",join_timeout_ms=" + std::to_string(seconds_option("--ft-join-timeout", o.ft_join_timeout).count());
    if (!o.ft_lighthouse_standby.empty()) {
      // Note [Lighthouse failover] in src/ft/lighthouse_failover.cpp.
      DTRAIN_CHECK(ft_nodes >= 2, ConfigError, "--ft-lighthouse-standby needs several nodes: node 1 keeps the standby.",
                   "pass --nnodes N --node-rank I (N >= 2), or drop --ft-lighthouse-standby");
      const auto standby = ft::parse_lighthouse_addresses("--ft-lighthouse-standby", o.ft_lighthouse_standby);
      DTRAIN_CHECK(
          standby.size() == 1, ConfigError,
          "--ft-lighthouse-standby " << o.ft_lighthouse_standby << " names " << standby.size() << " addresses.",
          "pass node 1's HOST:PORT only");
      plan.fault_tolerance.standby_host = standby[0].host;
      plan.fault_tolerance.standby_port = standby[0].port;
      if (o.node_rank == 1) {
        // The standby's lighthouse: its first quorum waits for the groups
        // that outlive node 0 (a later key overrides an earlier one).
        plan.fault_tolerance.lighthouse_config +=
            ",startup_replicas=" + std::to_string(o.ft_replicas - o.ft_replicas / ft_nodes) +
            ",primary=" + plan.fault_tolerance.lighthouse_host + ":" +
            std::to_string(plan.fault_tolerance.lighthouse_port) + ",failover_timeout_ms=" +
            std::to_string(seconds_option("--ft-failover-timeout", o.ft_failover_timeout).count());
      }
    }
  }
  plan.log_dir = o.log_dir;
  plan.tee = o.tee;
  // The flight recorder (docs/flight_recorder.md): workers inherit
  // DTRAIN_FLIGHT_RECORDER; they dump under DTRAIN_FLIGHT_RECORDER_DIR if set,
  // else LOG_DIR/flight_recorder, else the workers' default.
  if (const auto recorder = dist::flight_recorder_options(env); recorder.entries > 0) {
    const bool dir_set = env("DTRAIN_FLIGHT_RECORDER_DIR").has_value();
    const std::filesystem::path dir = !dir_set && !o.log_dir.empty()
                                          ? std::filesystem::path(o.log_dir) / "flight_recorder"
                                          : std::filesystem::path(recorder.dump_dir);
    plan.agent.flight_dump_dir = std::filesystem::absolute(dir).string();
  }
  plan.argv = o.program_and_args;
  plan.argv[0] = elastic::resolve_program(plan.argv[0]);
  plan.error_file_dir =
      (std::filesystem::temp_directory_path() / ("dtrain-run-" + std::to_string(::getpid()))).string();
  return plan;
}

}  // namespace dtrain::tools
