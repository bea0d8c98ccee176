// A parallelism plan as data, as a pipeline Schedule is: the mesh degrees,
// the ZeRO stage, the pipeline's schedule and micro-batches, activation
// recompute, precision and the global batch. It validates against the world
// and the model before anything runs, prints as a table, and reads and
// writes a JSON plan file.
//
//   dtrain::ParallelPlan plan{.pp = 2, .dp_shard = 2, .zero_stage = 2,
//                             .pipeline = {.schedule = "1f1b", .micro_batches = 4},
//                             .global_batch = 16};
//   plan.validate({.world = 4, .model = {.layers = 6, .heads = 4, .width = 128}});
//   dtrain::dist::DeviceMesh mesh(world, plan.mesh_dims());
//
// Degrees multiply to the world. dp_replicate ranks hold whole replicas and
// average gradients (DDP); dp_shard ranks shard by `zero_stage` (1:
// optimizer state, 2: + gradients, 3: + parameters); both together are HSDP.
// check_well_formed() accepts every plan that makes sense (the planner costs
// them all); validate() also refuses what no applier in this build
// implements yet (fp8 training), saying so, rather than failing mid-run. Tensor (with or without sequence) and context
// parallelism compose with dp_replicate, dp_shard (ZeRO 1-3), HSDP, pp and each other, up to the 4-D plan (docs/tp.md,
// "Compositions"). Recompute is applied by the program's model (dtrain::nn::checkpoint; examples/gpt per block); a
// program whose model has none refuses it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/mesh_dims.h"

namespace dtrain {

enum class Recompute { kNone, kSelective, kFull };
std::string to_string(Recompute r);
Recompute parse_recompute(const std::string& name);  // none | selective | full

struct PipelinePlan {
  std::string schedule = "1f1b";  // gpipe | 1f1b | interleaved | zb
  int stages_per_rank = 1;        // 2 or more: interleaved only
  int micro_batches = 1;          // per step and replica; divides its batch
  // One stage index per layer; empty: the placement planner's cut.
  std::vector<std::size_t> stage_of_layer;
  bool operator==(const PipelinePlan&) const = default;
};

// What validate() checks the plan against.
struct PlanContext {
  int world = 1;
  struct Model {
    std::int64_t layers = 0;  // pipeline-cuttable layers; 0: unknown
    std::int64_t heads = 0;   // attention heads (tp divides them); 0: unknown
    std::int64_t width = 0;   // hidden width (tp divides it); 0: unknown
    std::int64_t seq = 0;     // sequence length (cp splits it); 0: unknown
  } model;
};

struct ParallelPlan {
  int pp = 1, dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1;
  int zero_stage = 0;  // over dp_shard; 0: no sharding
  bool sequence_parallel = false;
  PipelinePlan pipeline;
  Recompute recompute = Recompute::kNone;
  int recompute_every = 1;         // every k-th layer
  std::string precision = "fp32";  // fp32 | bf16 | fp16 (autocast) | fp8 (planner only)
  std::int64_t global_batch = 0;   // sequences per optimizer step; 0: set by the program
  int accumulate = 1;              // micro-steps per optimizer step (outside the pipeline)

  int world() const { return pp * dp_replicate * dp_shard * cp * tp; }
  int data_parallel() const { return dp_replicate * dp_shard; }
  // Sequences per rank and micro-step: global_batch / (data_parallel x accumulate).
  std::int64_t local_batch() const;
  // The mesh of the degrees above 1, outermost first (a world of 1: none).
  std::vector<dist::MeshDim> mesh_dims() const;

  // ConfigError naming what is wrong and what to change: degrees, batch
  // split, pipeline cut and schedule, whatever this build can run.
  void check_well_formed(const PlanContext& context) const;
  // check_well_formed(), and a ConfigError for what this build cannot run.
  void validate(const PlanContext& context) const;
  // One row per field, aligned, for logs.
  std::string table() const;
  std::string to_json() const;
  // DataError for malformed JSON or an unknown field (a typo must not be
  // silently ignored); ConfigError for an invalid value.
  static ParallelPlan from_json(const std::string& text);
  bool operator==(const ParallelPlan&) const = default;
};

}  // namespace dtrain
