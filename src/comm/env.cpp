// Parsing and validation of the launcher/worker environment contract.
#include "dtrain/comm/env.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <utility>

#include "dtrain/comm/cluster_env.h"
#include "dtrain/comm/flight_recorder.h"
#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain::dist {
namespace {
constexpr const char* kLaunchHint =
    "start workers with `dtrain run`, torchrun, srun or mpirun, or set RANK, WORLD_SIZE, MASTER_ADDR and "
    "MASTER_PORT yourself";
constexpr int kMaxRanks = 1 << 20;

std::string require(const EnvLookup& env, const std::string& name) {
  auto value = env(name);
  DTRAIN_CHECK(value.has_value(), ConfigError, "environment variable " << name << " is not set.", kLaunchHint);
  return *value;
}
}  // namespace

namespace detail {
int parse_int(const std::string& what, const std::string& text, int min, int max) {
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  const bool whole = !text.empty() && end == text.c_str() + text.size() && errno == 0;
  DTRAIN_CHECK(whole, ConfigError, what << "='" << text << "' is not an integer.",
               "set " << what << " to a whole number in " << min << ".." << max);
  DTRAIN_CHECK(value >= min && value <= max, ConfigError,
               what << "=" << value << " is out of range " << min << ".." << max << ".",
               "set " << what << " to a whole number in " << min << ".." << max);
  return static_cast<int>(value);
}
}  // namespace detail

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

void validate(const EnvContract& c) {
  DTRAIN_CHECK(c.world_size >= 1, ConfigError, "WORLD_SIZE=" << c.world_size << " must be at least 1.", kLaunchHint);
  DTRAIN_CHECK(c.rank >= 0 && c.rank < c.world_size, ConfigError,
               "RANK=" << c.rank << " is not below WORLD_SIZE=" << c.world_size << ".",
               "ranks are numbered 0.." << c.world_size - 1 << "; check the launcher's --nnodes/--nproc-per-node");
  DTRAIN_CHECK(c.local_world_size >= 1 && c.local_world_size <= c.world_size, ConfigError,
               "LOCAL_WORLD_SIZE=" << c.local_world_size << " must be in 1..WORLD_SIZE=" << c.world_size << ".",
               kLaunchHint);
  DTRAIN_CHECK(c.local_rank >= 0 && c.local_rank < c.local_world_size, ConfigError,
               "LOCAL_RANK=" << c.local_rank << " is not below LOCAL_WORLD_SIZE=" << c.local_world_size << ".",
               kLaunchHint);
  DTRAIN_CHECK(!c.master_addr.empty(), ConfigError, "MASTER_ADDR is empty.",
               "set MASTER_ADDR to the host name or address of rank 0");
  DTRAIN_CHECK(c.master_port >= 1 && c.master_port <= 65535, ConfigError,
               "MASTER_PORT=" << c.master_port << " is out of range 1..65535.",
               "pick a free TCP port on rank 0's host");
}

std::string to_string(EnvSource source) {
  switch (source) {
    case EnvSource::kTorchrun: return "torchrun";
    case EnvSource::kSlurm: return "Slurm";
    case EnvSource::kOpenMpi: return "Open MPI";
    case EnvSource::kPmi: return "MPICH/PMI";
  }
  return "unknown";
}

namespace {
// torchrun's (and `dtrain run`'s, and a hand-written script's) variables.
EnvContract read_torchrun_contract(const EnvLookup& env) {
  EnvContract c;
  c.world_size = detail::parse_int("WORLD_SIZE", require(env, "WORLD_SIZE"), 1, kMaxRanks);
  c.rank = detail::parse_int("RANK", require(env, "RANK"), 0, kMaxRanks);
  c.master_addr = require(env, "MASTER_ADDR");
  c.master_port = detail::parse_int("MASTER_PORT", require(env, "MASTER_PORT"), 1, 65535);
  const auto local_rank = env("LOCAL_RANK");
  const auto local_world = env("LOCAL_WORLD_SIZE");
  c.local_rank = local_rank ? detail::parse_int("LOCAL_RANK", *local_rank, 0, kMaxRanks) : c.rank;
  c.local_world_size = local_world ? detail::parse_int("LOCAL_WORLD_SIZE", *local_world, 1, kMaxRanks) : c.world_size;
  if (const auto agent = env("TORCHELASTIC_USE_AGENT_STORE")) {
    c.agent_store = *agent == "True" || *agent == "true" || *agent == "1";
  }
  if (const auto restarts = env("TORCHELASTIC_RESTART_COUNT")) {
    c.restart_count = detail::parse_int("TORCHELASTIC_RESTART_COUNT", *restarts, 0, 1 << 30);
  }
  if (const auto group = env("GROUP_RANK")) c.group_rank = detail::parse_int("GROUP_RANK", *group, 0, kMaxRanks);
  if (const auto max = env("TORCHELASTIC_MAX_RESTARTS")) {
    c.max_restarts = detail::parse_int("TORCHELASTIC_MAX_RESTARTS", *max, 0, 1 << 30);
  }
  if (const auto id = env("TORCHELASTIC_RUN_ID")) c.run_id = *id;
  if (const auto role = env("ROLE_NAME")) c.role = *role;
  return c;
}

// The contract and the variables it came from, validated; logs nothing.
std::pair<EnvContract, std::string> read_contract(const EnvLookup& env) {
  EnvContract c;
  std::string origin;
  if (env("RANK") || env("WORLD_SIZE")) {
    c = read_torchrun_contract(env);
    origin = "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT";
  } else if (const auto task = read_cluster_task(env)) {
    c = to_contract(*task);
    origin = task->origin;
  } else {
    throw ConfigError(
        "no launcher's environment found: neither torchrun's RANK and WORLD_SIZE, nor Slurm's SLURM_PROCID, nor "
        "Open MPI's OMPI_COMM_WORLD_RANK, nor PMI_RANK is set.",
        kLaunchHint);
  }
  try {
    validate(c);
  } catch (const ConfigError& e) {
    if (c.source == EnvSource::kTorchrun) throw;
    throw ConfigError("from " + to_string(c.source) + "'s variables (" + origin + "): " + e.message(), e.hint());
  }
  return {c, origin};
}

void log_contract(const EnvContract& c, const std::string& origin) {
  const log::ScopedIdentity identity({.rank = c.rank, .world_size = c.world_size});
  DTRAIN_LOG(kInfo) << "environment: " << to_string(c.source) << " (" << origin << "): rank " << c.rank << " of "
                    << c.world_size << ", local rank " << c.local_rank << " of " << c.local_world_size << ", master "
                    << c.master_addr << ":" << c.master_port;
}
}  // namespace

EnvContract read_env_contract(const EnvLookup& env) {
  const auto [c, origin] = read_contract(env);
  log_contract(c, origin);
  return c;
}

EnvContract read_env_contract() {
  const auto [c, origin] = read_contract(process_env());
  log::set_process_rank(c.rank, c.world_size);
  // One line per process: programs read their contract where they need it.
  static std::once_flag logged;
  std::call_once(logged, [&] { log_contract(c, origin); });
  return c;
}

std::map<std::string, std::string> to_environment(const EnvContract& c) {
  const std::string rank = std::to_string(c.rank);
  return {{"RANK", rank},
          {"LOCAL_RANK", std::to_string(c.local_rank)},
          {"GROUP_RANK", std::to_string(c.group_rank)},
          {"ROLE_RANK", rank},
          {"WORLD_SIZE", std::to_string(c.world_size)},
          {"LOCAL_WORLD_SIZE", std::to_string(c.local_world_size)},
          {"ROLE_WORLD_SIZE", std::to_string(c.world_size)},
          {"MASTER_ADDR", c.master_addr},
          {"MASTER_PORT", std::to_string(c.master_port)},
          {"TORCHELASTIC_RESTART_COUNT", std::to_string(c.restart_count)},
          {"TORCHELASTIC_MAX_RESTARTS", std::to_string(c.max_restarts)},
          {"TORCHELASTIC_RUN_ID", c.run_id},
          {"TORCHELASTIC_USE_AGENT_STORE", c.agent_store ? "True" : "False"},
          {"ROLE_NAME", c.role}};
}

bool launched_by_launcher(const EnvLookup& env) {
  if (env("RANK").has_value() && env("WORLD_SIZE").has_value()) return true;
  return detail::cluster_launcher_present(env);
}

std::chrono::milliseconds default_timeout(std::chrono::milliseconds fallback, const EnvLookup& env) {
  const auto raw = env("DTRAIN_TIMEOUT_SECONDS");
  if (!raw) return fallback;
  errno = 0;
  char* end = nullptr;
  const double seconds = std::strtod(raw->c_str(), &end);
  const bool ok = !raw->empty() && end == raw->c_str() + raw->size() && errno == 0 && std::isfinite(seconds) &&
                  seconds > 0 && seconds < 1e9;
  DTRAIN_CHECK(ok, ConfigError, "DTRAIN_TIMEOUT_SECONDS='" << *raw << "' is not a positive number of seconds.",
               "set it to e.g. 60 or 0.5, or unset it for the default of " << fallback.count() / 1000 << " s");
  return std::chrono::milliseconds(std::max<long long>(1, std::llround(seconds * 1000.0)));
}

LinearKernel linear_kernel(const EnvLookup& env) {
  const auto raw = env("DTRAIN_LINEAR_KERNEL");
  if (!raw || raw->empty() || *raw == "auto") return LinearKernel::kAuto;
  if (*raw == "aten") return LinearKernel::kAten;
  if (*raw == "onednn") return LinearKernel::kOneDnn;
  throw ConfigError("DTRAIN_LINEAR_KERNEL='" + *raw + "' is not a kernel choice.",
                    "set it to 'aten' (at::linear everywhere), 'onednn' (oneDNN's matmul wherever it runs) or "
                    "'auto' (the faster for this CPU), or unset it");
}

FlightRecorderOptions flight_recorder_options(const EnvLookup& env) {
  FlightRecorderOptions options;
  if (const auto entries = env("DTRAIN_FLIGHT_RECORDER"); entries && !entries->empty()) {
    options.entries = detail::parse_int("DTRAIN_FLIGHT_RECORDER", *entries, 0, 1 << 24);
  }
  if (const auto dir = env("DTRAIN_FLIGHT_RECORDER_DIR"); dir && !dir->empty()) options.dump_dir = *dir;
  return options;
}

}  // namespace dtrain::dist
