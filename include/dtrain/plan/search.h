// The planner's search: every well-formed plan for a model, a cluster and a
// global batch (pp x dp_replicate x dp_shard x cp x tp, ZeRO stage, schedule,
// stages per rank, micro-batch size, recompute, sequence parallelism), those
// that do not fit in memory dropped, the rest ranked by predicted step time,
// ties (within 0.1 %) going to the plan that communicates less.
//
//   auto fixed = plan::FixedFields::parse("tp=8,pp=8,dp=24,micro_batch=1,schedule=interleaved");
//   auto r = plan::search(model, cluster, {.global_batch = 2304, .precision = "bf16", .fixed = fixed});
//   r.fitting.front();  // the best plan's estimate
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/plan/cost_model.h"

namespace dtrain::plan {

// Fields --fixed pins; the search chooses the rest.
struct FixedFields {
  std::optional<int> tp, pp, cp, dp, dp_replicate, dp_shard, zero, stages_per_rank;
  std::optional<std::int64_t> micro_batch;  // sequences per micro-batch and rank
  std::optional<std::string> schedule;
  std::optional<Recompute> recompute;
  std::optional<bool> sequence_parallel;
  // "tp=8,pp=8,dp=24,micro_batch=1,schedule=interleaved,recompute=full";
  // ConfigError naming an unknown field or a bad value.
  static FixedFields parse(const std::string& text);
};

struct SearchOptions {
  std::int64_t global_batch = 0;  // sequences per step
  std::string precision = "bf16";
  FixedFields fixed;
  int max_tp = 0;  // 0: the GPUs of one node
  int max_cp = 8;
  std::int64_t max_micro_batch = 16;
  int max_stages_per_rank = 8;
  CostOptions cost;
};

struct SearchResult {
  std::vector<PlanEstimate> fitting;  // best first
  std::size_t considered = 0;         // well-formed plans costed
  std::size_t too_big = 0;            // of those, refused for memory
  // When nothing fits: the plan that needs the least memory.
  std::optional<PlanEstimate> smallest;
};

SearchResult search(const ModelSpec& model, const Cluster& cluster, const SearchOptions& options);

// The plan nearest to `plan` that fits (fewest fields changed, then the
// fastest), with the same global batch and precision; nullopt when none does.
std::optional<PlanEstimate> cheapest_fitting_change(const ParallelPlan& plan, const ModelSpec& model,
                                                    const Cluster& cluster, const CostOptions& options = {});
// "tp 8 -> 4, recompute none -> full": the fields two plans differ in.
std::string describe_change(const ParallelPlan& from, const ParallelPlan& to);

}  // namespace dtrain::plan
