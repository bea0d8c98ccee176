// The memory pre-flight (preflight.h).
#include "dtrain/plan/preflight.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "dtrain/error.h"
#include "dtrain/plan/search.h"

namespace dtrain::plan {

std::int64_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double value = -1;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  if (unit == "K" || unit == "KiB") scale = 1024.0;
  if (unit == "M" || unit == "MiB") scale = 1024.0 * 1024;
  if (unit == "G" || unit == "GiB") scale = 1024.0 * 1024 * 1024;
  DTRAIN_CHECK(used > 0 && value > 0 && scale > 0, ConfigError, "'" << text << "' is not an amount of memory.",
               "write bytes, or a number with K, M or G (binary units), e.g. 300M");
  return static_cast<std::int64_t>(value * scale);
}

std::optional<MemoryLimit> stated_memory_limit(const std::string& given) {
  if (!given.empty()) return MemoryLimit{parse_bytes(given), "--memory-limit " + given};
  if (const char* env = std::getenv("DTRAIN_MEMORY_LIMIT"); env != nullptr && *env != '\0')
    return MemoryLimit{parse_bytes(env), std::string("DTRAIN_MEMORY_LIMIT=") + env};
  return std::nullopt;
}

MemoryLimit rank_memory_limit(int local_ranks, const std::string& given) {
  if (auto stated = stated_memory_limit(given)) return *stated;
  std::ifstream meminfo("/proc/meminfo");
  std::int64_t available = 0;
  for (std::string line; std::getline(meminfo, line);) {
    std::istringstream fields(line);
    std::string key;
    std::int64_t kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") available = kib * 1024;
  }
  DTRAIN_CHECK(available > 0, ConfigError, "cannot read this host's available memory from /proc/meminfo.",
               "state the limit per rank with --memory-limit or DTRAIN_MEMORY_LIMIT, or pass --no-memory-check");
  const int ranks = local_ranks > 0 ? local_ranks : 1;
  return {available / ranks, "this host's available memory (" + format_bytes(static_cast<double>(available)) + ") / " +
                                 std::to_string(ranks) + " local rank" + (ranks > 1 ? "s" : "")};
}

PlanEstimate check_plan_memory(const ParallelPlan& plan, const ModelSpec& model, const Cluster& cluster,
                               const CostOptions& options, const MemoryLimit& limit) {
  // The cluster's device with the limit as each rank's memory (a host's
  // memory is shared by its ranks: DeviceSpec::compute_units).
  Cluster limited = cluster;
  const int sharing = cluster.device.compute_units > 0 ? std::min(cluster.gpus_per_node, cluster.gpus) : 1;
  limited.device.memory_bytes = limit.bytes * sharing;
  CostOptions memory = options;
  memory.memory_only = true;
  const PlanEstimate e = estimate(plan, model, limited, memory);
  if (e.peak() <= static_cast<double>(limit.bytes)) return e;
  const auto& m = e.memory;
  std::ostringstream hint;
  if (auto change = cheapest_fitting_change(plan, model, limited, options)) {
    hint << "the nearest plan that fits: " << describe_change(plan, change->plan) << " ("
         << format_bytes(change->peak()) << " per rank); or more memory per rank, or --no-memory-check to run anyway";
  } else {
    hint << "no plan of " << cluster.gpus << " ranks fits: use more ranks or memory, a smaller model or batch, or "
         << "--no-memory-check to run anyway";
  }
  DTRAIN_CHECK(false, ConfigError,
               "the plan needs " << format_bytes(e.peak()) << " (" << static_cast<std::int64_t>(e.peak())
                                 << " bytes) per rank at its peak: parameters " << format_bytes(m.params)
                                 << ", gradients " << format_bytes(m.grads) << ", optimizer state "
                                 << format_bytes(m.optimizer) << ", activations " << format_bytes(m.activations)
                                 << ", logits " << format_bytes(m.logits) << ", captured gradients "
                                 << format_bytes(m.captured) << ", buffers " << format_bytes(m.buffers)
                                 << ", backward working memory " << format_bytes(m.backward) << "; that is "
                                 << format_bytes(e.peak() - static_cast<double>(limit.bytes)) << " ("
                                 << static_cast<std::int64_t>(e.peak()) - limit.bytes << " bytes) more than the "
                                 << format_bytes(static_cast<double>(limit.bytes)) << " (" << limit.bytes
                                 << " bytes) a rank may use (" << limit.source << ").",
               hint.str());
}

}  // namespace dtrain::plan
