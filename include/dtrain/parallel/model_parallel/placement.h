// Placement planning for model parallelism: which device runs which layer.
//
// Layers keep their order and each device gets one contiguous run of them
// (possibly none), so activations cross devices at most d-1 times. Among the
// placements that respect every device's memory budget, the planner picks one
// that minimises the largest per-device load: profiled compute time when every
// layer has one, else memory. It is exact (dynamic programming over split
// points, O(devices x layers^2)).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

struct LayerCost {
  std::string name;
  std::int64_t bytes = 0;  // memory the layer pins on its device (parameters, buffers, ...)
  double compute = 0;      // profiled forward+backward seconds; 0 = not profiled
};

struct Placement {
  std::vector<std::size_t> device_of_layer;  // device index per layer, non-decreasing
  std::vector<std::int64_t> bytes_per_device;
  std::vector<double> load_per_device;  // what was balanced (compute or bytes)
  bool balanced_compute = false;
};

// Plans layers onto `device_count` devices. `budgets` holds one byte budget per
// device, or is empty for unlimited memory. Throws ConfigError when no
// placement fits, saying how much memory is missing: the bytes beyond the sum
// of budgets, or else the smallest amount that, added to every device's
// budget, would let a contiguous split fit (e.g. a layer bigger than any device).
Placement plan_placement(const std::vector<LayerCost>& layers, std::size_t device_count,
                         const std::vector<std::int64_t>& budgets = {});

// "1.5 MiB", "312 B": for messages.
std::string format_bytes(std::int64_t bytes);

}  // namespace dtrain
