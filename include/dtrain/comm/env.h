// The launcher/worker environment contract.
//
// A worker learns its place in the job from environment variables with
// torchrun's names, so one program runs under `dtrain run`, torchrun, or a
// hand-written script:
//   RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT      required
//   LOCAL_RANK, LOCAL_WORLD_SIZE                    optional; default to RANK and
//                                                   WORLD_SIZE (one node)
// torch elastic's, when present:
//   TORCHELASTIC_USE_AGENT_STORE   "True": the launcher's agent already hosts
//                                  the store on MASTER_PORT (torchrun and
//                                  `dtrain run` do), so rank 0 connects as a client
//   TORCHELASTIC_RESTART_COUNT     keys of each restart round are kept apart
//                                  (/worker/attempt_N), because torchrun's
//                                  agent store outlives a round
// and dtrain's own:
//   DTRAIN_TIMEOUT_SECONDS   overrides the default timeout of blocking calls.
//   DTRAIN_LINEAR_KERNEL     "aten": dtrain::nn::linear runs at::linear
//                            (benchmarks' like-for-like runs); "onednn":
//                            oneDNN's matmul wherever it runs; "auto" or
//                            unset: the faster of the two for this CPU.
// Without RANK and WORLD_SIZE, the contract comes from the job scheduler's or
// MPI launcher's own variables: Slurm's, then Open MPI's, then MPICH/PMI's
// (cluster_env.h). One log line per read says which was used.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>

namespace dtrain::dist {

// Whose variables a contract was read from, in the order they are tried.
enum class EnvSource { kTorchrun, kSlurm, kOpenMpi, kPmi };
// "torchrun", "Slurm", "Open MPI", "MPICH/PMI".
std::string to_string(EnvSource source);

struct EnvContract {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE
  int restart_count = 0;     // TORCHELASTIC_RESTART_COUNT
  // Written by launchers, optional for readers:
  int group_rank = 0;                       // GROUP_RANK: the node's rank
  int max_restarts = 0;                     // TORCHELASTIC_MAX_RESTARTS
  std::string run_id;                       // TORCHELASTIC_RUN_ID; a cluster's job id
  std::string role = "default";             // ROLE_NAME (torchrun's --role)
  EnvSource source = EnvSource::kTorchrun;  // set by read_env_contract
};

// The variables a launcher sets for a worker with `contract` (torchrun's
// full set, ROLE_* included). The one writer of the contract that
// read_env_contract reads.
std::map<std::string, std::string> to_environment(const EnvContract& contract);

// Looks up one variable; std::nullopt when unset. Tests pass fakes.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// The process environment.
EnvLookup process_env();

// Reads and validates the contract: torchrun's when RANK or WORLD_SIZE is set,
// else the first cluster launcher's (cluster_env.h); logs one line naming the
// source. Throws ConfigError naming the variable for a missing or malformed
// value (also when no launcher's variables are set at all), RANK >=
// WORLD_SIZE, LOCAL_RANK >= LOCAL_WORLD_SIZE, or a port outside 1..65535.
EnvContract read_env_contract(const EnvLookup& env);
// The same from this process's environment; the rank becomes the process's
// log and error tag (log::set_process_rank), and the line naming the source
// is logged once per process, however often a program reads it.
EnvContract read_env_contract();

// Checks an explicitly built contract the same way read_env_contract does.
void validate(const EnvContract& contract);

// True when a launcher started us: RANK and WORLD_SIZE are both set, or a
// cluster launcher's rank variable is (SLURM_PROCID under srun,
// OMPI_COMM_WORLD_RANK, PMI_RANK).
bool launched_by_launcher(const EnvLookup& env = process_env());

// Default timeout of blocking calls: DTRAIN_TIMEOUT_SECONDS (fractions
// allowed) when set, else `fallback`. Throws ConfigError when malformed.
std::chrono::milliseconds default_timeout(std::chrono::milliseconds fallback = std::chrono::minutes(30),
                                          const EnvLookup& env = process_env());

// Which kernels dtrain::nn runs (nn/linear.h; attention.h and gelu.h follow it).
enum class LinearKernel {
  kAuto,    // the faster kernel for this CPU (nn/linear.h: oneDNN's matmul on non-Intel x86, at::linear elsewhere)
  kAten,    // always ATen's kernels (at::linear, ...): what a PyTorch program runs, for like-for-like comparisons
  kOneDnn,  // oneDNN's matmul wherever it runs (fp32 CPU), e.g. to measure it on an Intel CPU
};
// DTRAIN_LINEAR_KERNEL: "auto" (also when unset or empty), "aten" or
// "onednn". Throws ConfigError naming the value otherwise.
LinearKernel linear_kernel(const EnvLookup& env = process_env());

namespace detail {
// Parses a whole decimal integer in [min, max]; ConfigError names `what`.
int parse_int(const std::string& what, const std::string& text, int min, int max);
}  // namespace detail

}  // namespace dtrain::dist
