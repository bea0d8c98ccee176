// Contiguous min-max partitioning of layers onto devices under memory budgets.
#include "dtrain/parallel/model_parallel/placement.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <numeric>
#include <sstream>

#include "dtrain/error.h"

namespace dtrain {
namespace {

constexpr double kInfeasible = std::numeric_limits<double>::infinity();

struct Plan {
  double worst = kInfeasible;
  std::vector<std::size_t> device_of_layer;
};

// best[j][i]: the least possible maximum load when layers [0, i) go to
// devices [0, j), each device taking a contiguous (maybe empty) run.
Plan solve(const std::vector<LayerCost>& layers, std::size_t d, const std::vector<std::int64_t>& budgets,
           std::int64_t extra, bool use_compute) {
  const std::size_t n = layers.size();
  std::vector<std::int64_t> bytes_prefix(n + 1, 0);
  std::vector<double> load_prefix(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) {
    bytes_prefix[i + 1] = bytes_prefix[i] + layers[i].bytes;
    load_prefix[i + 1] = load_prefix[i] + (use_compute ? layers[i].compute : static_cast<double>(layers[i].bytes));
  }
  auto fits = [&](std::size_t j, std::size_t s, std::size_t i) {
    return budgets.empty() || bytes_prefix[i] - bytes_prefix[s] <= budgets[j] + extra;
  };
  std::vector<std::vector<double>> best(d + 1, std::vector<double>(n + 1, kInfeasible));
  std::vector<std::vector<std::size_t>> split(d + 1, std::vector<std::size_t>(n + 1, 0));
  best[0][0] = 0;
  for (std::size_t j = 1; j <= d; ++j) {
    for (std::size_t i = 0; i <= n; ++i) {
      for (std::size_t s = 0; s <= i; ++s) {
        if (best[j - 1][s] == kInfeasible || !fits(j - 1, s, i)) continue;
        const double worst = std::max(best[j - 1][s], load_prefix[i] - load_prefix[s]);
        // Ties go to the later split, which fills earlier devices first.
        if (worst <= best[j][i]) {
          best[j][i] = worst;
          split[j][i] = s;
        }
      }
    }
  }
  Plan plan;
  plan.worst = best[d][n];
  if (plan.worst == kInfeasible) return plan;
  plan.device_of_layer.assign(n, 0);
  for (std::size_t j = d, i = n; j > 0; --j) {
    const std::size_t s = split[j][i];
    for (std::size_t l = s; l < i; ++l) plan.device_of_layer[l] = j - 1;
    i = s;
  }
  return plan;
}

}  // namespace

std::string format_bytes(std::int64_t bytes) {
  char text[64];
  const double b = static_cast<double>(bytes);
  if (bytes < 1024) {
    std::snprintf(text, sizeof text, "%lld B", static_cast<long long>(bytes));
  } else if (b < 1024.0 * 1024) {
    std::snprintf(text, sizeof text, "%.1f KiB", b / 1024);
  } else if (b < 1024.0 * 1024 * 1024) {
    std::snprintf(text, sizeof text, "%.1f MiB", b / (1024.0 * 1024));
  } else {
    std::snprintf(text, sizeof text, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  }
  return text;
}

Placement plan_placement(const std::vector<LayerCost>& layers, std::size_t device_count,
                         const std::vector<std::int64_t>& budgets) {
  DTRAIN_CHECK(device_count > 0, ConfigError, "model placement needs at least one device.", "pass --devices");
  DTRAIN_CHECK(budgets.empty() || budgets.size() == device_count, ConfigError,
               budgets.size() << " memory budgets were given for " << device_count << " devices.",
               "give one budget per device, or none");
  for (const auto& l : layers) {
    DTRAIN_CHECK(l.bytes >= 0 && l.compute >= 0, ConfigError,
                 "layer '" << l.name << "' has a negative cost (" << l.bytes << " bytes, " << l.compute << " s).",
                 "costs are sizes and times");
  }
  const bool use_compute =
      !layers.empty() && std::all_of(layers.begin(), layers.end(), [](const LayerCost& l) { return l.compute > 0; });
  Plan plan = solve(layers, device_count, budgets, 0, use_compute);
  if (plan.worst == kInfeasible) {
    const std::int64_t total = std::accumulate(layers.begin(), layers.end(), std::int64_t{0},
                                               [](std::int64_t a, const LayerCost& l) { return a + l.bytes; });
    const std::int64_t capacity = std::accumulate(budgets.begin(), budgets.end(), std::int64_t{0});
    std::ostringstream budget_list;
    for (std::size_t j = 0; j < budgets.size(); ++j) budget_list << (j ? ", " : "") << format_bytes(budgets[j]);
    if (total > capacity) {
      throw ConfigError("the model does not fit: it needs " + format_bytes(total) + " but the devices' budgets (" +
                            budget_list.str() + ") hold " + format_bytes(capacity) + "; " +
                            format_bytes(total - capacity) + " missing.",
                        "add devices, raise the budgets, or shrink the model");
    }
    // Enough in total, but no contiguous split fits: find the least extra per device.
    std::int64_t lo = 0, hi = total;  // `hi` extra always fits everything on one device
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (solve(layers, device_count, budgets, mid, false).worst != kInfeasible) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const auto largest = std::max_element(layers.begin(), layers.end(),
                                          [](const LayerCost& a, const LayerCost& b) { return a.bytes < b.bytes; });
    throw ConfigError("the model does not fit: its " + format_bytes(total) + " fit the budgets (" + budget_list.str() +
                          ") in total, but no split into contiguous runs of layers does (largest "
                          "layer: '" +
                          largest->name + "', " + format_bytes(largest->bytes) + "); " + format_bytes(lo) +
                          " missing on each device.",
                      "raise every budget by " + format_bytes(lo) + ", add a device, or split the largest layers");
  }
  Placement out;
  out.device_of_layer = std::move(plan.device_of_layer);
  out.balanced_compute = use_compute;
  out.bytes_per_device.assign(device_count, 0);
  out.load_per_device.assign(device_count, 0);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const auto j = out.device_of_layer[l];
    out.bytes_per_device[j] += layers[l].bytes;
    out.load_per_device[j] += use_compute ? layers[l].compute : static_cast<double>(layers[l].bytes);
  }
  return out;
}

}  // namespace dtrain
