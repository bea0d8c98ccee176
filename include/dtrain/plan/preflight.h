// The memory pre-flight: before a program trains a plan, the cost model's
// peak memory per rank against what a rank may use, and a ConfigError that
// says what does not fit, by how much, and the nearest plan that fits,
// instead of an out-of-memory error in the middle of a run.
//
//   auto limit = plan::rank_memory_limit(local_ranks, "");   // env / host / given
//   plan::check_plan_memory(plan, model, cluster, {}, limit);  // throws when it does not fit
//
// The Trainer runs it before the first step, all ranks deciding together
// (TrainerOptions::memory_check, dtrain/trainer/memory_check.h);
// docs/planner.md lists its errors.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "dtrain/plan/cost_model.h"

namespace dtrain::plan {

// Bytes one rank may use, and where that figure comes from (for messages).
struct MemoryLimit {
  std::int64_t bytes = 0;
  std::string source;
};

// "4096", "512K", "300M", "2G" (binary units); ConfigError otherwise.
std::int64_t parse_bytes(const std::string& text);

// A limit the user stated: `given` (e.g. --memory-limit) when not empty,
// else $DTRAIN_MEMORY_LIMIT when set (tests state a small limit this way);
// nullopt when neither is. The one reader of DTRAIN_MEMORY_LIMIT.
std::optional<MemoryLimit> stated_memory_limit(const std::string& given = "");

// The stated limit (stated_memory_limit), else this host's available memory
// (MemAvailable) divided by the ranks on it.
MemoryLimit rank_memory_limit(int local_ranks, const std::string& given = "");

// The plan's estimate; ConfigError when its peak per rank exceeds
// `limit.bytes`: the peak and its parts, the excess, and the nearest plan
// that fits (cheapest_fitting_change) or that none does.
PlanEstimate check_plan_memory(const ParallelPlan& plan, const ModelSpec& model, const Cluster& cluster,
                               const CostOptions& options, const MemoryLimit& limit);

}  // namespace dtrain::plan
