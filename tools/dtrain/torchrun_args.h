// torchrun's command line and PET_* variables, for `dtrain run`.
//
// torchrun takes each option's default from the variable PET_<OPTION>
// (PET_NNODES for --nnodes, PET_NPROC_PER_NODE for --nproc-per-node, ...;
// Kubeflow's PyTorchJob sets them) and the command line wins over it
// (torch/distributed/argparse_util.py). Before `dtrain run` parses its
// arguments, these are rewritten into the one spelling the parser knows:
//   - each PET_* variable whose option is not on the command line becomes
//     that option, placed before the user's (flags such as PET_STANDALONE
//     count when they hold a non-zero integer, as torchrun's check_env);
//   - torchrun's valued `--tee 3`, `-t 3` and `--tee=3` become
//     `--tee-streams 3` (dtrain's own `--tee` is a flag; a `--tee` followed
//     by something other than 0-3 or a per-rank map stays that flag).
// Scanning stops at PROGRAM: the first argument that is neither an option
// nor an option's value.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "dtrain/comm/env.h"
#include "launch_options.h"

namespace dtrain::tools {

struct TorchrunArguments {
  std::vector<std::string> args;      // rewritten, ready for the parser
  std::vector<std::string> from_pet;  // "PET_NNODES=1:2", ... for the log
};

// `args` are `dtrain run`'s arguments after "run".
TorchrunArguments rewrite_torchrun_arguments(const std::vector<std::string>& args,
                                             const dist::EnvLookup& env = dist::process_env());

// torchrun's options that `dtrain run` does not share under the same name
// (--rdzv-backend, --master-addr, --role, --redirects, ...), and those it
// refuses, so that the refusal can say why.
void add_torchrun_options(CLI::App& run, LaunchOptions& options);

// Applies torchrun's output and shutdown options to dtrain's (--redirects
// and --tee to --log-dir/--tee, --shutdown-timeout to --stop-grace) and
// throws ConfigError saying why for what dtrain does not do.
void apply_torchrun_options(LaunchOptions& options);

// torchrun's stream selector (--redirects, --tee): "0".."3" or "LOCAL_RANK:N,...".
bool is_torchrun_streams(const std::string& text);

}  // namespace dtrain::tools
