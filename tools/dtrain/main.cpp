// dtrain: the command-line tool. `dtrain run` launches training workers like
// torchrun: one process per rank under the env contract, per-rank logs,
// restarts on failure, signal forwarding. See docs/launcher.md.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "ckpt_dispatch.h"
#include "dtrain/comm/device.h"
#include "dtrain/comm/flight_analysis.h"
#include "dtrain/elastic/agent.h"
#include "dtrain/elastic/replica_agent.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/net.h"
#include "launch_options.h"
#include "libdtrain_loader.h"
#include "plan_command.h"
#include "torchrun_args.h"

namespace {
std::atomic<int> g_interrupt{0};

void on_signal(int sig) {
  g_interrupt.store(sig);
}

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

// Runs `agent` (an Agent or a ReplicaAgent) until it ends, with SIGINT/SIGTERM
// stopping the workers, and removes the workers' error files. Success and an
// interrupt end here (their exit code); a failure is for the caller to report.
template <typename AgentT>
std::pair<dtrain::elastic::AgentResult, std::optional<int>> run_agent(AgentT& agent,
                                                                      const dtrain::tools::LaunchPlan& plan) {
  install_signal_handlers();
  auto result = agent.run(g_interrupt);
  std::filesystem::remove_all(plan.error_file_dir);
  if (result.state == dtrain::elastic::AgentState::kSucceeded) return {result, 0};
  if (result.state == dtrain::elastic::AgentState::kInterrupted) {
    std::cerr << "dtrain run: interrupted; workers stopped" << std::endl;
    return {result, result.exit_code};
  }
  return {result, std::nullopt};
}

// --ft-replicas: replica groups under a lighthouse (replica_agent.h).
int run_replica_groups(const dtrain::tools::LaunchOptions& opt, const dtrain::tools::LaunchPlan& plan) {
  namespace el = dtrain::elastic;
  dtrain::tools::BackgroundWorkerStore lighthouse(
      dtrain::tools::BackgroundWorkerStore::Lighthouse{plan.fault_tolerance.lighthouse_config});
  el::ReplicaAgent agent(
      {.agent = plan.agent,
       .replicas = plan.fault_tolerance.replicas,
       .lighthouse_port = plan.fault_tolerance.lighthouse_port,
       .nodes = plan.fault_tolerance.nodes,
       .node_rank = plan.fault_tolerance.node_rank,
       .lighthouse_host = plan.fault_tolerance.lighthouse_host,
       .linger = plan.fault_tolerance.linger,
       .standby_host = plan.fault_tolerance.standby_host,
       .standby_port = plan.fault_tolerance.standby_port,
       .lighthouse_serves =
           [](const std::string& host, int port) {
             return dtrain::tools::lighthouse_serves(host, port, std::chrono::seconds(2));
           }},
      [&plan](int replica) {
        const std::string sub = "/replica_" + std::to_string(replica);
        return std::make_unique<el::ProcessWorkerGroup>(
            el::ProcessWorkerGroupOptions{.argv = plan.argv,
                                          .log_dir = plan.log_dir.empty() ? "" : plan.log_dir + sub,
                                          .tee = plan.tee,
                                          .hang_timeout = plan.hang_timeout,
                                          .error_file_dir = plan.error_file_dir + sub});
      },
      [] { return std::make_unique<dtrain::tools::BackgroundWorkerStore>(); }, lighthouse);
  const auto [result, ended] = run_agent(agent, plan);
  if (ended) return *ended;
  std::cerr << "dtrain run: failed after " << result.restarts << " replica-group restart"
            << (result.restarts == 1 ? "" : "s") << " (--max-restarts " << opt.max_restarts << " per group)\n"
            << "  root cause: " << result.root_cause_text << std::endl;
  return result.exit_code;
}

int run_command(const dtrain::tools::LaunchOptions& opt) {
  namespace el = dtrain::elastic;
  const auto plan = dtrain::tools::plan_launch(opt);
  if (plan.fault_tolerance.replicas > 0) return run_replica_groups(opt, plan);
  el::ProcessWorkerGroup workers({.argv = plan.argv,
                                  .log_dir = plan.log_dir,
                                  .tee = plan.tee,
                                  .hang_timeout = plan.hang_timeout,
                                  .error_file_dir = plan.error_file_dir});
  dtrain::tools::BackgroundWorkerStore worker_store;  // node rank 0 hosts it: see agent.h
  std::unique_ptr<el::StoreRendezvous> rendezvous;
  if (plan.rendezvous.multi_node) {
    auto r = plan.rendezvous.options;
    r.local_addr = plan.rendezvous.local_addr.empty()
                       ? dtrain::net::local_address_towards(plan.rendezvous.host, plan.rendezvous.port)
                       : plan.rendezvous.local_addr;
    auto store = dtrain::tools::load_tcp_rendezvous_store(plan.rendezvous.host, plan.rendezvous.port, r.timeout,
                                                          plan.rendezvous.secret);
    r.port = plan.rendezvous.port;
    r.reconnect = [secret = plan.rendezvous.secret](const std::string& host, int port, bool host_it,
                                                    std::chrono::milliseconds timeout) {
      return dtrain::tools::load_tcp_rendezvous_store(host, port, timeout, secret,
                                                      host_it ? el::StoreRole::kHost : el::StoreRole::kClient);
    };
    rendezvous = std::make_unique<el::StoreRendezvous>(std::move(store), r);
  }
  el::Agent agent = rendezvous ? el::Agent(plan.agent, workers, worker_store, *rendezvous)
                               : el::Agent(plan.agent, workers, worker_store);
  const auto [result, ended] = run_agent(agent, plan);
  if (ended) return *ended;
  std::cerr << "dtrain run: failed after " << result.restarts << " restart" << (result.restarts == 1 ? "" : "s")
            << " (--max-restarts " << opt.max_restarts << ")\n"
            << "  root cause: " << (result.root_cause_text.empty() ? "unknown" : result.root_cause_text) << std::endl;
  if (!result.flight_report.empty()) {
    std::istringstream lines(result.flight_report);
    for (std::string line; std::getline(lines, line);) std::cerr << "  flight recorder: " << line << "\n";
    std::cerr << std::flush;
  }
  return result.exit_code;
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain: distributed training for C++ programs"};
  app.require_subcommand(1);
  dtrain::tools::LaunchOptions opt;
  CLI::App* run = app.add_subcommand("run", "Launch PROGRAM as a group of training workers (like torchrun)");
  dtrain::tools::add_launch_options(*run, opt);
  dtrain::tools::PlanCommandOptions plan_opt;
  CLI::App* plan = app.add_subcommand(
      "plan", "Predict memory and step time of parallelism plans, search them, refuse what does not fit");
  dtrain::tools::add_plan_options(*plan, plan_opt);
  // dtrain ckpt: dtrain's checkpoints and the ecosystem's formats
  // (docs/checkpoints.md), done in libdtrain (loaded only for this command).
  CLI::App* ckpt = app.add_subcommand(
      "ckpt", "Inspect, convert and consolidate checkpoints (dtrain's, safetensors, torch.save, DCP)");
  ckpt->require_subcommand(1);
  dtrain::tools::CkptRequest ckpt_req;
  const std::string inputs =
      "a dtrain checkpoint folder (or one step_<N>), a DCP folder (.metadata), a .safetensors file, a folder with "
      "model.safetensors[.index.json], or a .pt";
  CLI::App* inspect = ckpt->add_subcommand(
      "inspect", "List a checkpoint: step, plan, tensors (dtype, shape, bytes, layout), CRC check, metadata");
  inspect->add_option("path", ckpt_req.input, inputs)->required();
  inspect->add_option("--key", ckpt_req.key, "in a .pt holding a dict of state dicts, the entry to read (e.g. model)");
  CLI::App* convert =
      ckpt->add_subcommand("convert", "Convert between dtrain, safetensors, Hugging Face folders, torch.save and DCP");
  convert->add_option("--to", ckpt_req.to, "output format")
      ->required()
      ->check(CLI::IsMember({"safetensors", "hf", "torch", "dcp"}));
  convert->add_option("input", ckpt_req.input, inputs)->required();
  convert
      ->add_option("output", ckpt_req.output,
                   "a file (.safetensors or .pt), a folder for sharded safetensors or a Hugging Face model (--to hf), "
                   "or a DCP folder")
      ->required();
  convert->add_option("--key", ckpt_req.key, "in a .pt holding a dict of state dicts, the entry to read (e.g. model)");
  convert->add_option("--max-shard-bytes", ckpt_req.max_shard_bytes, "shard size of a safetensors folder")
      ->capture_default_str();
  CLI::App* consolidate =
      ckpt->add_subcommand("consolidate", "One full model (every parameter unsharded) from a sharded checkpoint");
  consolidate->add_option("input", ckpt_req.input, "a dtrain checkpoint folder (or one step_<N>), or a DCP folder")
      ->required();
  consolidate->add_option("output", ckpt_req.output, "a .safetensors or .pt file, or a sharded safetensors folder")
      ->required();
  consolidate->add_option("--max-shard-bytes", ckpt_req.max_shard_bytes, "shard size of a safetensors folder")
      ->capture_default_str();
  // dtrain trace analyze: the flight recorder's dumps (docs/flight_recorder.md),
  // the same analysis `dtrain run` reports when a round fails.
  CLI::App* trace = app.add_subcommand("trace", "Read the flight recorder's dumps");
  trace->require_subcommand(1);
  std::string trace_dir;
  CLI::App* analyze = trace->add_subcommand(
      "analyze", "Say which rank kept the others waiting in which operation, from the ranks' dumps in DIR");
  analyze->add_option("dir", trace_dir, "the folder of rank_<R>.json dumps (DTRAIN_FLIGHT_RECORDER_DIR)")->required();
  // torchrun's PET_* variables and spellings (tools/dtrain/torchrun_args.h).
  std::vector<std::string> args(argv + 1, argv + argc);
  std::vector<std::string> from_pet;
  if (!args.empty() && args.front() == "run") {
    auto rewritten = dtrain::tools::rewrite_torchrun_arguments({args.begin() + 1, args.end()});
    args.resize(1);
    args.insert(args.end(), rewritten.args.begin(), rewritten.args.end());
    from_pet = std::move(rewritten.from_pet);
  }
  try {
    std::reverse(args.begin(), args.end());  // CLI11 takes them last first
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (plan->parsed()) {
    try {
      return dtrain::tools::plan_command(plan_opt, std::cout, std::cerr);
    } catch (const dtrain::Error& e) {
      std::cerr << "dtrain plan: error: " << e.what() << std::endl;
      return 2;
    }
  }
  if (trace->parsed()) {
    try {
      std::cout << dtrain::dist::analyze_flight_dumps(trace_dir).text() << std::flush;
      return 0;
    } catch (const std::exception& e) {  // dtrain's errors, and anything a malformed dump still causes
      std::cerr << "dtrain trace: error: " << e.what() << std::endl;
      return 2;
    }
  }
  if (ckpt->parsed()) {
    try {
      ckpt_req.command = inspect->parsed() ? "inspect" : convert->parsed() ? "convert" : "consolidate";
      return dtrain::tools::ckpt_command(ckpt_req, std::cout);
    } catch (const dtrain::Error& e) {
      std::cerr << "dtrain ckpt: error: " << e.what() << std::endl;
      return 2;
    }
  }
  try {
    if (!from_pet.empty()) {
      std::string list;
      for (const auto& v : from_pet) list += (list.empty() ? "" : " ") + v;
      DTRAIN_LOG(kInfo) << "environment: torchrun's PET_* variables as option defaults: " << list;
    }
    opt.program_and_args = run->remaining();
    return run_command(opt);
  } catch (const dtrain::Error& e) {
    std::cerr << "dtrain run: error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::cerr << "dtrain run: error: " << what.substr(0, what.find('\n')) << std::endl;
    return 2;
  }
}
