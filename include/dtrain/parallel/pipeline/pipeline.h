// Pipeline parallelism: a model cut into stages on the ranks of a group,
// trained by running one schedule's action lists (schedule.h).
//
//   // rank r of a pipeline group of p ranks holds stages r, r + p, ... (v per rank)
//   std::vector<dtrain::pipeline::PipelineStage> mine = {{.module = stage_r}};
//   dtrain::pipeline::Pipeline pipe(std::move(mine), group, {.schedule = ScheduleKind::k1F1B, .micro_batches = 8},
//   loss_fn); torch::optim::SGD opt(pipe.parameters(), 0.1); opt.zero_grad(); at::Tensor loss = pipe.step(x, y);   //
//   forward and backward of every micro-batch opt.step();                          // loss: the batch's mean, defined
//   on the last stage's rank
//
// Semantics: the batch (dim 0 of input and target) is cut into m equal
// micro-batches; the last stage computes loss_fn(output_i, target_i) and
// backward runs on loss_i / m, so gradients are those of the batch mean (for a
// loss that is a mean over the micro-batch). `input` is read on the rank of
// the first stage only, `target` on that of the last; other ranks may pass
// undefined tensors. Gradients accumulate into the parameters' .grad.
//
// Shapes: the first step agrees on every activation's shape and dtype (each
// sender tells its receiver once); every step then checks, on every rank, the
// micro-batch shape against the agreed one (a broadcast from the first stage's
// rank of a few integers), so a changed batch is a ConfigError on all ranks
// rather than a hang. A stage whose output changes shape with the same input
// fails with ConfigError on the sender; its peers then fail by timeout or,
// when it exits, with a CommunicationError naming it.
//
// Communication: activations and gradients move by isend/irecv of the
// pipeline group; sends complete in the background and are waited for at the
// end of the step. Every failure (a stage process gone, a timeout) surfaces as
// dtrain::CommunicationError naming the peer, from step().
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "dtrain/parallel/model_parallel/placement.h"
#include "dtrain/parallel/pipeline/schedule.h"
#include "dtrain/parallel/pipeline/stage_sync.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"

namespace dtrain::amp {
class GradScaler;
}

namespace dtrain::pipeline {

// A parameter one stage uses but another owns (a tied weight: the GPT head's
// output projection is the first stage's token embedding). Both ranks hold a
// copy; after backward the two gradients are summed and both copies get the
// sum, so identical optimizers keep them identical.
struct TiedParameter {
  at::Tensor parameter;
  int other_stage = 0;  // the stage holding the other copy
  bool owner = false;   // the owner's copy counts in gradient_set()
};

struct PipelineStage {
  torch::nn::Sequential module;
  // Parameters of `module` are the stage's own; these are shared with another
  // stage. List a tie on both sides (the owner's copy must be among its
  // module's parameters), also when both stages share a rank and the copies
  // are one tensor: backward runs w.r.t. a stage's parameters, and the
  // borrower's entry is how it reaches the tied one.
  std::vector<TiedParameter> tied;
};

// Which stage each of `layers`' layers goes to for `stage_count` contiguous
// stages: the placement planner's (plan_placement, model_parallel/placement.h)
// balance of `costs` (one per layer, e.g. profiled compute; default: parameter
// bytes) under `budgets` (bytes per stage, empty: unlimited), every stage
// given at least one layer. ConfigError with fewer layers than stages, or
// when no cut fits the budgets (saying how much memory is missing).
std::vector<std::size_t> plan_stages(const torch::nn::Sequential& layers, int stage_count,
                                     std::vector<LayerCost> costs = {}, const std::vector<std::int64_t>& budgets = {});
// The layers of each stage as a Sequential of its own (sharing the modules).
std::vector<torch::nn::Sequential> split_stages(const torch::nn::Sequential& layers,
                                                const std::vector<std::size_t>& stage_of_layer);

struct PipelineOptions {
  ScheduleKind schedule = ScheduleKind::k1F1B;
  int micro_batches = 1;
  // When set, the ranks holding the same stage in other pipeline replicas (a
  // mesh's data-parallel group): every stage's gradients are averaged over it
  // by `stage_sync`, so every replica steps alike (DP x PP). Each replica must
  // hold the same stages, initialised alike (DDP and ZeRO broadcast the data
  // group's first rank's parameters at construction).
  std::optional<dist::ProcessGroup> data_parallel_group;
  // The data-parallel applier each stage gets (stage_sync.h): DDP (default),
  // ZeRO 1-3 or one all-reduce; without a data group of 2+ ranks, none.
  StageSyncFactory stage_sync = ddp_stage_sync();
  // Record each compute action's start and end in step() (see trace()).
  bool record_trace = false;
  // The mesh the stages' parameters are laid out over, for stages whose
  // parameters are not all replicated (tensor-parallel layers: Shard on tp).
  // The pipeline group must be mesh["pp"] and the data-parallel group a
  // group of the mesh: dp_replicate (DDP), dp_shard, or dp_shard x cp with
  // ZeroOptions::shard_dims saying so (context-parallel stages). Global
  // norms (gradient_set()) then come from the layouts
  // (GradientSet::from_layouts, partitioned over pp): each stage's
  // parameters, or its ZeRO shards (norm_layouts()), counted once over the
  // mesh. Contract: every stage shards the same mesh dimensions
  // (e.g. each has a tensor-parallel layer), since all ranks must combine
  // over the same groups. Unset: parameters are replicated outside the
  // pipeline and data groups. Activations between stages are whatever the
  // stage modules send: with tensor-parallel stages, tp-replicated (a row
  // layer's all-reduced output), each tp rank exchanging with its own peer
  // in the pp group.
  std::optional<dist::DeviceMesh> mesh;
};

// One compute action of the last step, in the order run (record_trace).
struct TracedAction {
  Action action;
  std::chrono::steady_clock::time_point start, end;
  // The calling thread's CPU time the action took (CLOCK_THREAD_CPUTIME_ID):
  // on a shared host, still one core's rate where wall time is not.
  double cpu_seconds = 0;
  // For I (ActionKind::kBackwardInput): the autograd nodes whose output
  // gradient the split backward captured for W (0 where the stage has no
  // input path and W runs the whole backward); 0 for other actions.
  int captured_nodes = 0;
};

using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

class Pipeline {
 public:
  // `stages`: this rank's stages in model order (schedule.stages_of_rank);
  // `group`: the pipeline group (its size p; stages_per_rank = stages.size()).
  Pipeline(std::vector<PipelineStage> stages, dist::ProcessGroup group, PipelineOptions options, LossFn loss_fn);
  ~Pipeline();
  Pipeline(Pipeline&&) noexcept;
  Pipeline& operator=(Pipeline&&) noexcept;

  // Forward and backward of one batch by the schedule; the gradients of the
  // batch-mean loss accumulate into .grad (tied and data-parallel reductions
  // done). With `scaler`, each micro-batch loss is scaled by it (unscale with
  // a found_inf_group spanning all stages). Returns the (unscaled) mean loss
  // on the last stage's rank, an undefined tensor elsewhere.
  at::Tensor step(const at::Tensor& input, const at::Tensor& target, amp::GradScaler* scaler = nullptr);
  // Evaluation: forward only, no graph kept; the model's output for the whole
  // batch on the last stage's rank, undefined elsewhere.
  at::Tensor forward(const at::Tensor& input);

  // Every parameter this rank updates (own and tied copies): for the
  // optimizer. Under a sharding applier (ZeRO): this rank's shards of its
  // stages' parameters (the borrowers' tied copies are then not stepped: they
  // receive the owner's weight at each step's start).
  std::vector<at::Tensor> parameters() const;
  // The gradients for global norms across stages: each parameter counted
  // once over the pipeline group (tied copies on their owner only), and, when
  // sharded, each shard once over the data-parallel group.
  const GradientSet& gradient_set() const;
  // Clears every gradient parameters() steps on (and, sharded, the full
  // gradients the strategy keeps).
  void zero_grad();
  // Under ZeRO: each local stage's engine (its shards, optimizer-state
  // layout, full_parameters(); e.g. for checkpoints), in stage order; empty
  // otherwise.
  std::vector<ShardedDataParallel*> sharded_stages();
  // dtrain::clip_grad_norm_ over gradient_set(), and the same factor applied
  // to tied copies (which gradient_set() leaves out), so they stay equal.
  // Collective over the pipeline group; returns the global norm.
  at::Tensor clip_grad_norm_(double max_norm, const ClipGradNormOptions& options = {});

  const Schedule& schedule() const;
  const std::vector<PipelineStage>& stages() const;
  const dist::ProcessGroup& group() const;
  // Most micro-batches whose activations this rank held at once during the
  // last step (forward done, backward not), over its stages.
  int peak_activations() const;
  // The last step's compute actions with times (empty unless record_trace).
  const std::vector<TracedAction>& trace() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::pipeline
