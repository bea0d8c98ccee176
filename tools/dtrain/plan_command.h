// `dtrain plan`: predict the memory and step time of parallelism plans for a
// model on a cluster, search them, print the best (a table, or one JSON
// object per plan and line), write the best as a plan file, and refuse, with
// the figure and the nearest plan that fits, when nothing fits.
// See docs/planner.md.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <iosfwd>
#include <string>

namespace dtrain::tools {

struct PlanCommandOptions {
  std::string model;  // gpt:... | llama:...
  std::string device = "h100-80gb";
  int gpus = 0;
  int gpus_per_node = 0;  // 0: the device's
  std::int64_t global_batch = 0;
  std::string precision = "bf16";
  std::string fixed;  // "tp=8,pp=8,..."
  bool json = false;
  int top = 10;                      // plans printed; 0: all that fit
  std::string output;                // write the best plan here (ParallelPlan JSON)
  std::string weights = "megatron";  // megatron | fp32-master
  double allocator_factor = 1.0;
  bool no_grad_overlap = false;
  bool blocking_p2p = false;
  bool ddp_bucket_copy = false;
  bool list_devices = false;
  // --device-file: a device entry (calibration.h) instead of --device; with
  // --calibrate, where the measured entry is written.
  std::string device_file;
  bool calibrate = false;
  std::string calibrate_ranks = "2,4";  // process counts the collectives are timed on
};

// Where `dtrain plan --calibrate` writes by default and `--device cpu-here`
// reads from when it exists: $DTRAIN_CACHE or ~/.cache/dtrain, cpu-here.json.
std::string default_calibration_file();

void add_plan_options(CLI::App& command, PlanCommandOptions& options);
// 0: plans printed; 1: nothing fits (the message says by how much and what
// to change). Throws dtrain::Error for bad options.
int plan_command(const PlanCommandOptions& options, std::ostream& out, std::ostream& err);

}  // namespace dtrain::tools
