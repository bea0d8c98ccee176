// torchrun's spellings and PET_* variables rewritten for `dtrain run`'s parser.
#include "torchrun_args.h"

#include <algorithm>
#include <cctype>
#include <regex>

#include "dtrain/error.h"

namespace dtrain::tools {
namespace {

struct OptionSpelling {
  std::vector<std::string> names;  // every spelling; the first is the one the parser gets
  const char* pet = nullptr;       // torchrun's PET_ variable, if torchrun has the option
  bool flag = false;               // takes no value
  const char* old_pet = nullptr;   // an older spelling still set by some operators
};

// Every option `dtrain run` parses (tools/dtrain/launch_options.cpp), with
// torchrun's variable where torchrun has it.
const std::vector<OptionSpelling>& spellings() {
  static const std::vector<OptionSpelling> table = {
      {{"--nnodes"}, "PET_NNODES"},
      // Kubeflow's training-operator wrote PET_N_PROC_PER_NODE before v1.7.
      {{"--nproc-per-node", "--nproc_per_node"}, "PET_NPROC_PER_NODE", false, "PET_N_PROC_PER_NODE"},
      {{"--rdzv-backend", "--rdzv_backend"}, "PET_RDZV_BACKEND"},
      {{"--rdzv-endpoint", "--rdzv_endpoint"}, "PET_RDZV_ENDPOINT"},
      {{"--rdzv-id", "--rdzv_id"}, "PET_RDZV_ID"},
      {{"--rdzv-conf", "--rdzv_conf"}, "PET_RDZV_CONF"},
      {{"--standalone"}, "PET_STANDALONE", true},
      {{"--max-restarts", "--max_restarts"}, "PET_MAX_RESTARTS"},
      {{"--monitor-interval", "--monitor_interval"}, "PET_MONITOR_INTERVAL"},
      {{"--start-method", "--start_method"}, "PET_START_METHOD"},
      {{"--event-log-handler", "--event_log_handler"}, "PET_EVENT_LOG_HANDLER"},
      {{"--role"}, "PET_ROLE"},
      {{"--module", "-m"}, "PET_MODULE", true},
      {{"--no-python", "--no_python"}, "PET_NO_PYTHON", true},
      {{"--run-path", "--run_path"}, "PET_RUN_PATH", true},
      {{"--log-dir", "--log_dir"}, "PET_LOG_DIR"},
      {{"--redirects", "-r"}, "PET_REDIRECTS"},
      {{"--tee-streams"}, "PET_TEE"},
      {{"--log-line-prefix-template", "--log_line_prefix_template"}, "PET_LOG_LINE_PREFIX_TEMPLATE"},
      {{"--local-ranks-filter", "--local_ranks_filter"}, "PET_LOCAL_RANKS_FILTER"},
      {{"--duplicate-stdout-filters", "--duplicate_stdout_filters"}, "PET_DUPLICATE_STDOUT_FILTERS"},
      {{"--duplicate-stderr-filters", "--duplicate_stderr_filters"}, "PET_DUPLICATE_STDERR_FILTERS"},
      {{"--node-rank", "--node_rank"}, "PET_NODE_RANK"},
      {{"--master-addr", "--master_addr"}, "PET_MASTER_ADDR"},
      {{"--master-port", "--master_port"}, "PET_MASTER_PORT"},
      {{"--local-addr", "--local_addr"}, "PET_LOCAL_ADDR"},
      {{"--logs-specs", "--logs_specs"}},
      {{"--numa-binding", "--numa_binding"}},
      {{"--signals-to-handle", "--signals_to_handle"}, "PET_SIGNALS_TO_HANDLE"},
      {{"--shutdown-timeout", "--shutdown_timeout"}, "PET_SHUTDOWN_TIMEOUT"},
      {{"--virtual-local-rank", "--virtual_local_rank"}, "PET_VIRTUAL_LOCAL_RANK", true},
      // dtrain's own
      {{"--rdzv-timeout", "--rdzv_timeout"}},
      {{"--rdzv-secret-file", "--rdzv_secret_file"}},
      {{"--devices"}},
      {{"--hang-timeout"}},
      {{"--stop-grace"}},
      {{"--tee"}, nullptr, true},
  };
  return table;
}

const OptionSpelling* find_spelling(const std::string& name) {
  for (const auto& s : spellings()) {
    if (std::find(s.names.begin(), s.names.end(), name) != s.names.end()) return &s;
  }
  return nullptr;
}

bool nonzero_integer(const std::string& text) {
  try {
    std::size_t used = 0;
    const long v = std::stol(text, &used);
    return used == text.size() && v != 0;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

bool is_torchrun_streams(const std::string& text) {
  static const std::regex pattern("[0-3]|[0-9]+:[0-3](,[0-9]+:[0-3])*");
  return std::regex_match(text, pattern);
}

TorchrunArguments rewrite_torchrun_arguments(const std::vector<std::string>& args, const dist::EnvLookup& env) {
  TorchrunArguments out;
  std::vector<std::string> user;
  std::vector<const OptionSpelling*> given;
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--" || a.size() < 2 || a[0] != '-') break;  // PROGRAM starts here
    const auto eq = a.find('=');
    const std::string name = a.substr(0, eq);
    const bool tee_value = (name == "--tee" || name == "-t") &&
                           (eq != std::string::npos || (i + 1 < args.size() && is_torchrun_streams(args[i + 1])));
    if (tee_value) {  // torchrun's --tee 3, not dtrain's flag
      given.push_back(find_spelling("--tee-streams"));
      user.push_back(eq != std::string::npos ? "--tee-streams" + a.substr(eq) : "--tee-streams");
      if (eq == std::string::npos) user.push_back(args[++i]);
      continue;
    }
    const OptionSpelling* s = find_spelling(name);
    user.push_back(a);
    if (s == nullptr) continue;  // unknown: the parser says so
    given.push_back(s);
    if (!s->flag && eq == std::string::npos && i + 1 < args.size()) user.push_back(args[++i]);
  }
  // `dtrain run [options] -- PROGRAM ARGS` (as torchrun users type it): the
  // separator is ours, not the program's; a later "--" is the program's.
  if (i < args.size() && args[i] == "--") ++i;
  user.insert(user.end(), args.begin() + static_cast<std::ptrdiff_t>(i), args.end());

  for (const auto& s : spellings()) {
    if (s.pet == nullptr || std::find(given.begin(), given.end(), &s) != given.end()) continue;
    const char* pet = s.pet;
    auto value = env(pet);
    if (!value && s.old_pet != nullptr) value = env(pet = s.old_pet);
    if (!value || value->empty()) continue;
    if (s.flag) {
      if (!nonzero_integer(*value)) continue;
      out.args.push_back(s.names.front());
    } else {
      out.args.push_back(s.names.front() + "=" + *value);
    }
    out.from_pet.push_back(std::string(pet) + "=" + *value);
  }
  out.args.insert(out.args.end(), user.begin(), user.end());
  return out;
}

}  // namespace dtrain::tools

namespace dtrain::tools {
namespace {
// torchrun options dtrain refuses, and why.
struct Refusal {
  const char* names;
  const char* why;
};
constexpr Refusal kRefused[] = {
    {"--log-line-prefix-template,--log_line_prefix_template",
     "dtrain prefixes each tee'd line with [rank R]; templates are not supported"},
    {"--local-ranks-filter,--local_ranks_filter",
     "dtrain shows every rank's output; use --log-dir for one file per rank"},
    {"--duplicate-stdout-filters,--duplicate_stdout_filters", "dtrain does not copy filtered lines to other files"},
    {"--duplicate-stderr-filters,--duplicate_stderr_filters", "dtrain does not copy filtered lines to other files"},
    {"--signals-to-handle,--signals_to_handle",
     "dtrain forwards SIGINT and SIGTERM to the workers; other signals are not configurable"},
    {"--logs-specs,--logs_specs",
     "logs specs are Python entry points; dtrain's layout is LOG_DIR/attempt_N/rank_R.log"},
    {"--numa-binding,--numa_binding", "dtrain does not bind workers to NUMA nodes; run PROGRAM under numactl"},
};

std::string primary(const char* names) {
  const std::string all = names;
  return all.substr(0, all.find(','));
}

void check_streams(const char* option, const std::string& value) {
  DTRAIN_CHECK(is_torchrun_streams(value), ConfigError,
               option << " " << value << " is not 0, 1, 2, 3 or LOCAL_RANK:N,...",
               "as torchrun: 0 none, 1 stdout, 2 stderr, 3 both");
  DTRAIN_CHECK(
      value == "0" || value == "3", ConfigError,
      option << " " << value << ": dtrain captures a worker's stdout and stderr together, in one file per rank.",
      "use " << option << " 3 (both streams, every rank) or 0");
}
}  // namespace

void add_torchrun_options(CLI::App& run, LaunchOptions& o) {
  const std::string group = "torchrun's options";
  run.add_option("--rdzv-backend,--rdzv_backend", o.rdzv_backend,
                 "c10d (the store at --rdzv-endpoint; the default with one) or static (nodes ranked by --node-rank, "
                 "the store at --master-addr:--master-port)")
      ->group(group);
  run.add_option("--master-addr,--master_addr", o.master_addr, "Static backend: the host of node rank 0 (127.0.0.1)")
      ->group(group);
  run.add_option("--master-port,--master_port", o.master_port, "Static backend: the store's port (29500)")
      ->group(group);
  run.add_option("--local-addr,--local_addr", o.local_addr, "This node's address as the other nodes reach it")
      ->group(group);
  run.add_option("--role", o.role, "The workers' role (ROLE_NAME)")->capture_default_str()->group(group);
  run.add_option("-r,--redirects", o.redirects, "3: each rank's output to LOG_DIR (as --log-dir); 0: console")
      ->group(group);
  run.add_option("--tee-streams", o.tee_streams, "torchrun's --tee 3: to LOG_DIR and the console")->group("");
  run.add_option("--start-method,--start_method", o.start_method, "spawn (workers are new processes)")->group(group);
  run.add_option("--event-log-handler,--event_log_handler", o.event_log_handler, "null only")->group(group);
  run.add_option("--shutdown-timeout,--shutdown_timeout", o.shutdown_timeout, "Seconds; as --stop-grace")->group(group);
  run.add_flag("--no-python,--no_python", o.no_python, "Accepted: dtrain always runs PROGRAM as given")->group(group);
  run.add_flag("-m,--module", o.module, "Refused: write `dtrain run python -m MODULE`")->group(group);
  run.add_flag("--run-path,--run_path", o.run_path, "Refused: write `dtrain run python SCRIPT`")->group(group);
  for (const auto& r : kRefused) {
    run.add_option_function<std::string>(
           r.names, [&o, name = primary(r.names)](const std::string& v) { o.unsupported[name] = v; },
           std::string("Refused: ") + r.why)
        ->group(group);
  }
  run.add_flag_function(
         "--virtual-local-rank,--virtual_local_rank",
         [&o](std::int64_t) { o.unsupported["--virtual-local-rank"] = "1"; },
         "Refused: every worker sees its own LOCAL_RANK; use --devices for visibility")
      ->group(group);
}

void apply_torchrun_options(LaunchOptions& o) {
  for (const auto& [name, value] : o.unsupported) {
    for (const auto& r : kRefused) {
      if (primary(r.names) == name)
        throw ConfigError("torchrun's " + name + " is not supported: " + r.why + ".", "drop " + name);
    }
    throw ConfigError("torchrun's " + name + " is not supported: each worker already has its own LOCAL_RANK.",
                      "drop " + name + "; --devices sets CUDA_VISIBLE_DEVICES");
  }
  DTRAIN_CHECK(!o.module, ConfigError, "-m/--module: dtrain run starts PROGRAM as given, with no Python of its own.",
               "write `dtrain run [options] python -m MODULE [ARGS]`");
  DTRAIN_CHECK(!o.run_path, ConfigError, "--run-path runs a script inside torchrun's interpreter; dtrain has none.",
               "write `dtrain run [options] python SCRIPT [ARGS]`");
  DTRAIN_CHECK(o.start_method.empty() || o.start_method == "spawn", ConfigError,
               "--start-method " << o.start_method << ": dtrain starts every worker as a new process (spawn).",
               "drop --start-method; fork and forkserver apply to Python functions");
  DTRAIN_CHECK(o.event_log_handler.empty() || o.event_log_handler == "null", ConfigError,
               "--event-log-handler " << o.event_log_handler << ": dtrain logs its events to stderr only.",
               "drop --event-log-handler");
  if (o.shutdown_timeout >= 0) o.stop_grace = o.shutdown_timeout;
  // torchrun: --redirects 3 writes both streams to files, --tee 3 to files and the console.
  if (!o.tee_streams.empty()) {
    check_streams("--tee", o.tee_streams);
    o.tee = o.tee || o.tee_streams == "3";
  }
  if (!o.redirects.empty()) {
    check_streams("--redirects", o.redirects);
    DTRAIN_CHECK(o.redirects == "3" || o.log_dir.empty() || o.tee, ConfigError,
                 "--redirects 0 with --log-dir: dtrain's --log-dir always captures every rank's output.",
                 "drop --redirects 0 to write to LOG_DIR, or drop --log-dir for the console only");
  }
  const bool to_files = o.redirects == "3" || o.tee_streams == "3";
  DTRAIN_CHECK(!to_files || !o.log_dir.empty(), ConfigError,
               (o.tee_streams == "3" ? "--tee 3" : "--redirects 3") << " needs --log-dir.",
               "pass --log-dir DIR (torchrun would pick a temporary directory)");
}

}  // namespace dtrain::tools
