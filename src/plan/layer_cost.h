// Private to the cost model: the alpha-beta collectives and the time one
// transformer layer (and the embedding and output ends) takes per
// micro-batch on one rank. See Note [Layer time] in layer_cost.cpp.
#pragma once

#include <cstdint>

#include "dtrain/plan/device_table.h"
#include "dtrain/plan/model_spec.h"
#include "dtrain/plan/plan.h"

namespace dtrain::plan::detail {

// Ring algorithms: `bytes` is the whole buffer (all-reduce: its size; gather
// and reduce-scatter: the gathered size); a group of 1 costs nothing.
double all_reduce_seconds(double bytes, int ranks, const Link& link);
double gather_seconds(double bytes, int ranks, const Link& link);
double p2p_seconds(double bytes, const Link& link);
// A gather's (or reduce-scatter's) bandwidth term alone: the transport's
// work, without the call's and the hops' latency (Note [Collectives issued
// ahead on time-sliced ranks] in cost_model.cpp).
double gather_work_seconds(double bytes, int ranks, const Link& link);
// ... and its latency alone: the call's and the hops'.
double gather_latency_seconds(int ranks, const Link& link);

struct LayerShape {
  std::int64_t micro_batch = 1;  // sequences
  int tp = 1, cp = 1;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::kNone;
  int bytes_per_element = 2;   // activations: 2 (bf16, fp16) or 4 (fp32)
  double peak_flops = 0;       // of the device at this precision (GEMMs)
  double attention_flops = 0;  // attention's (fp8 plans: the bf16 rate); 0: peak_flops
  Link tp_link, cp_link;
  // Communication may run beside compute (a GPU's copy engines, a CPU host
  // with a core to spare); false: it adds (Note [Communication on a CPU
  // host] in cost_model.cpp).
  bool overlap_comm = true;
};

// Seconds per micro-batch; compute and communication kept apart so the
// breakdown can show them.
struct PhaseTimes {
  double forward = 0, backward_input = 0, backward_weight = 0, recompute = 0;
  double tp_forward = 0, tp_backward = 0, tp_recompute = 0;
  double cp_exposed = 0;      // forward and backward together
  double hardware_flops = 0;  // forward + backward + recompute FLOPs on this rank
  double model_flops = 0;     // forward + backward FLOPs on this rank
};

PhaseTimes layer_times(const ModelSpec& model, const LayerShape& shape, const DeviceSpec& device);
// Logits, loss and final norm (the last stage).
PhaseTimes output_times(const ModelSpec& model, const LayerShape& shape, const DeviceSpec& device);
// Token (and position) embedding (the first stage).
PhaseTimes embedding_times(const ModelSpec& model, const LayerShape& shape, const DeviceSpec& device);

}  // namespace dtrain::plan::detail
