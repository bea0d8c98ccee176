// The planner's cost model: per-rank peak memory and step time of a
// ParallelPlan for a model on a cluster, without running anything. The
// model, its assumptions and its measured errors: docs/planner.md.
//
//   auto model = plan::ModelSpec::parse("gpt:layers=24,hidden=2304,heads=24,seq=2048,vocab=51200");
//   plan::Cluster cluster{.device = plan::find_device("a100-80gb"), .gpus = 32};
//   ParallelPlan p{.dp_replicate = 32, .recompute = Recompute::kFull, .precision = "bf16", .global_batch = 512};
//   auto e = plan::estimate(p, model, cluster);
//   e.tflops_per_gpu; e.peak_memory_bytes; e.fits;
//
// Memory: weights, gradients and optimizer state by ZeRO stage and
// precision; activations per layer by recompute mode, TP/SP/CP degree,
// times the micro-batches the schedule's action list holds at once;
// communication buffers. Time: each pipeline rank's action list replayed
// (replay.h) with per-stage F / I / W times built from GEMM, attention and
// element-wise costs plus the TP collectives on the critical path, then the
// gradient synchronisation's exposed part and the optimizer step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/plan/device_table.h"
#include "dtrain/plan/model_spec.h"
#include "dtrain/plan/plan.h"

namespace dtrain::plan {

// Where mixed precision keeps its copies (bytes per parameter):
//  kMegatron:   bf16 weights and gradients, fp32 master weights and Adam
//               moments in the optimizer: 2 + 2 + 12 (ZeRO's accounting).
//  kFp32Master: fp32 weights and gradients, bf16 only inside autocast
//               (dtrain's AMP, torchtitan's FSDP2): 4 + 4 + 8.
// fp32 plans use 4 + 4 + 8 either way.
enum class WeightLayout { kMegatron, kFp32Master };

// Bytes the optimizer phase moves per local fp32 parameter: AdamW's 28
// (weight, gradient, two moments read, three written back) and clipping by
// the global norm's 12 (each gradient read for the norm, then scaled in
// place); Note [Optimizer phase] in cost_model.cpp.
inline constexpr double kOptimizerBytesPerParam = 28 + 12;

struct CostOptions {
  WeightLayout weights = WeightLayout::kMegatron;
  std::int64_t ddp_bucket_bytes = 25LL << 20;  // DDP and ZeRO-1/2 gradient buckets
  // dtrain's engines (`--ddp-bucket-copy`): DDP's buckets copy the gradients
  // (as PyTorch DDP without gradient_as_bucket_view: one more gradient's
  // bytes), gradients exist only from a backward to zero_grad (which sets
  // them to none), ZeRO-1 reduces its flat gradient buffer in place and
  // ZeRO-2 moves gradients into its reduce-scatter input (Note [Gradient
  // lifetimes]); false: gradients are views of a contiguous buffer that
  // lives through the step and two buckets are in flight (Megatron).
  bool ddp_buckets_copy_gradients = false;
  int zero3_prefetch_units = 1;  // layers gathered ahead of the one running
  // DDP / ZeRO-1/2 buckets reduce while backward runs (dtrain, PyTorch DDP);
  // false: after backward (Megatron-LM 2021's local DDP).
  bool overlap_grad_reduce = true;
  // Pipeline senders wait for their transfers (Megatron-LM 2021); false:
  // asynchronous sends with receives posted ahead (dtrain's executor).
  bool blocking_p2p = false;
  // Reserved / allocated by the caching allocator (fragmentation), applied
  // to the peak; 1: none.
  double allocator_factor = 1.0;
  // Memory only: skip the replay (the search's first pass); the time fields
  // stay 0.
  bool memory_only = false;
};

struct MemoryBreakdown {  // bytes on one rank, at its peak
  double params = 0, grads = 0, optimizer = 0, activations = 0, logits = 0, buffers = 0;
  double captured = 0;  // the split backward's (ZB) gradients kept between I and W
  double backward = 0;  // a backward's working memory (Note [Backward working memory])
  double total() const { return params + grads + optimizer + activations + logits + captured + buffers + backward; }
};

struct TimeBreakdown {       // seconds per step on the critical pipeline rank
  double compute = 0;        // F, I, W of every micro-batch, without recompute or communication
  double recompute = 0;      // forward work redone in backward
  double tp_comm = 0;        // TP / SP collectives (on the critical path)
  double cp_comm = 0;        // context-parallel K/V exchange left after overlap
  double zero3_comm = 0;     // ZeRO-3 gathers and reduce-scatters left after overlap
  double pipeline_idle = 0;  // bubble and point-to-point waits: makespan - busy
  double grad_sync = 0;      // DP / ZeRO-1/2 gradient reduction and parameter gather left after overlap
  double meeting = 0;        // time-sliced CPU ranks meeting after the compute (DeviceSpec::oversubscribed_meeting)
  double optimizer = 0;      // the optimizer step (memory-bound)
  double step = 0;
};

struct PlanEstimate {
  ParallelPlan plan;
  std::int64_t micro_batch = 0;           // sequences per micro-batch and rank
  std::vector<double> peak_memory_bytes;  // per pipeline rank (equal across its dp, cp and tp ranks)
  MemoryBreakdown memory;                 // of the rank with the highest peak
  TimeBreakdown time;
  double step_seconds = 0;
  double tokens_per_second = 0;  // whole cluster
  double tokens_per_second_per_gpu = 0;
  double tflops_per_gpu = 0;  // hardware FLOPs (recompute counted), as Megatron reports
  double mfu = 0;             // model FLOPs (no recompute) / peak
  double comm_bytes = 0;      // bytes each rank sends per step (ties in the search)
  std::int64_t device_memory_bytes = 0;
  bool fits = false;
  double peak() const;
  // One line of JSON: plan, peak_memory_bytes, step_seconds, tokens_per_second,
  // tflops_per_gpu, mfu, and the breakdowns.
  std::string to_json() const;
};

// The plan must be well-formed for the model and the cluster
// (ParallelPlan::check_well_formed); ConfigError otherwise.
PlanEstimate estimate(const ParallelPlan& plan, const ModelSpec& model, const Cluster& cluster,
                      const CostOptions& options = {});

// Peak activation bytes of one layer for one micro-batch on one rank,
// exposed for tests against Korthikanti et al. 2022's formulas.
struct ActivationShape {
  std::int64_t micro_batch = 1;
  int tp = 1, cp = 1;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::kNone;
  int bytes_per_element = 2;
};
double layer_activation_bytes(const ModelSpec& model, const ActivationShape& shape);
// Bytes of the gradients the split backward (ZB's I) keeps for W, one layer
// and micro-batch on one rank: each weight GEMM's and norm's output gradient
// (Note [Captured gradients]).
double layer_captured_gradient_bytes(const ModelSpec& model, const ActivationShape& shape);

// "12.3 GiB", "512.0 MiB" or "3.5 KiB" (the largest unit under which the
// value is at least 1), for tables and messages.
std::string format_bytes(double bytes);

}  // namespace dtrain::plan
