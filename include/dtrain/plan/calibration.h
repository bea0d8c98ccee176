// This host measured for the planner (`dtrain plan --calibrate`): the
// samples a calibration run takes, the alpha-beta fit of its collectives,
// and the device entry they make, stored as a JSON file that
// `dtrain plan --device-file F` reads instead of a row of the built-in table.
//
//   auto link = plan::fit_ring_link(samples);           // alpha, beta of one transport
//   plan::write_device_file("here.json", device);      // after a calibration
//   plan::DeviceSpec d = plan::read_device_file("here.json");
#pragma once

#include <string>
#include <vector>

#include "dtrain/plan/device_table.h"
#include "dtrain/plan/model_spec.h"

namespace dtrain::plan {

// One timed collective: `op` all_reduce | all_gather | reduce_scatter over
// `ranks` ranks of `bytes` (the whole buffer, as layer_cost.h counts it).
struct CollectiveSample {
  std::string op;
  int ranks = 2;
  double bytes = 0;
  double seconds = 0;
};

// The Link whose ring formulas (all-reduce 2(k-1) alpha + 2(k-1)/k n/beta;
// gather and reduce-scatter half that) fit the samples best in the least
// squares of relative error (so small and large messages weigh alike).
// ConfigError with fewer than two distinct message sizes, or a fit without a
// positive latency and bandwidth (then the samples are noise).
Link fit_ring_link(const std::vector<CollectiveSample>& samples);

// One calibration run's collectives after compute (calibrate_worker.cpp's
// "after_compute"): the median collective's added wall from the ranks'
// clocks, and the median round's wall time with the collectives and
// without (`collectives` more in the former).
struct AfterComputeRun {
  int ranks = 0;
  double collective_seconds = 0;
  double wall_seconds = 0;
  double compute_wall_seconds = 0;
  int collectives = 0;
  double bytes = 0;
  // Time-sliced runs only (0 otherwise): the median round's wall time with an
  // all_gather of `ahead_bytes` (gathered) issued before each piece of
  // compute and waited for after it, `ahead_collectives` a round.
  double ahead_wall_seconds = 0;
  int ahead_collectives = 0;
  double ahead_bytes = 0;
};

// Note [Collectives after compute] (calibration.cpp): the seconds a
// collective after compute added to `run` on a host of `cores` cores: with a
// core per rank the clocks' median, with more ranks than cores the rounds'
// wall difference per collective.
double collective_added_seconds(const AfterComputeRun& run, int cores);

// Note [Collectives after compute] (calibration.cpp): what each all-reduce of
// `bytes` over `ranks` ranks that followed a piece of compute added
// (`seconds_per_collective`, collective_added_seconds) beyond what the
// `synchronised` link charges for it (0 when none is left over).
double collectives_after_compute_latency(int ranks, double seconds_per_collective, double bytes,
                                         const Link& synchronised);

// Note [Collectives issued ahead on time-sliced ranks] (cost_model.cpp):
// what each all_gather issued ahead of compute added to `run` (a run with
// more ranks than cores) beyond the `sliced` link's transport work for its
// bytes (0 when none is left over): DeviceSpec::oversubscribed_ahead_latency.
// ConfigError without ahead rounds or a fitted link.
double collectives_ahead_latency(const AfterComputeRun& run, const Link& sliced);

// Note [Optimizer phase] (cost_model.cpp): the bytes/s at which the optimizer
// phase moved kOptimizerBytesPerParam per parameter, `params` of them in
// `seconds` (DeviceSpec::optimizer_bandwidth). ConfigError without both.
double optimizer_bandwidth(std::int64_t params, double seconds);

// Note [Split backward cost] (calibration.cpp): the seconds the pipeline
// executor's split backward costs beyond the same backward whole, per node
// whose gradient it captures: (I + W - B) / captured, 0 when none is left.
double split_backward_overhead(double whole_seconds, double split_seconds, int captured);

// Note [Element-wise passes on a calibrated host] (calibration.cpp): the
// cost model's seconds for the forward and backward of the calibration's
// layer (one GPT-example layer: width 128, 4 heads, inner 512, 64 tokens,
// fp32, eager kernels, no biases or dropout; `attention` as the calibration
// ran it) on `micro_batch` sequences on `device`, its elementwise_factor
// included; and the elementwise_factor that makes that layer take
// `measured_seconds` on `device` (its rates calibrated), clamped to
// [0.25, 4], and 1 when `measured_seconds` is not positive.
double calibration_layer_seconds(const DeviceSpec& device, Attention attention, std::int64_t micro_batch);
double elementwise_factor(const DeviceSpec& device, Attention attention, std::int64_t micro_batch,
                          double measured_seconds);

// One device entry as JSON (every DeviceSpec field) and back; read_device_file
// names the file and the field on a bad or missing one (ConfigError).
std::string device_to_json(const DeviceSpec& device);
DeviceSpec device_from_json(const std::string& text);
void write_device_file(const std::string& path, const DeviceSpec& device);
DeviceSpec read_device_file(const std::string& path);

}  // namespace dtrain::plan
