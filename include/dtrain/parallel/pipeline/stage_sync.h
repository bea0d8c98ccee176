// How a pipeline stage's gradients are synchronised over its data-parallel
// group (DP x PP): one small interface the executor calls at fixed points of
// a step, implemented by the data-parallel appliers (DDP over a replicated
// layout, ZeRO over a sharded one). The executor never asks which one it
// holds.
//
// Note [Stage gradients over the data-parallel group]
// A stage runs m forwards and m backwards per step. The executor calls, per
// local stage:
//   begin_step(training)      before the stage's first forward of a step (or
//                             of an evaluation);
//   forward(x)                for each micro-batch;
//   before_last_backward()    right before the backward that completes the
//                             stage's gradients (B or W of its last
//                             micro-batch in the rank's action list); it
//                             returns whether that backward must be one
//                             autograd run;
//   end_step()                after the rank's last action of the step.
// The contract every applier keeps: the backwards before the last one
// accumulate full local gradients (as under no_sync); during the last one the
// gradients are reduced (averaged) over the data group, overlapped with that
// backward where the applier can; after end_step() the gradients the
// optimizer steps on (parameters()) hold the data group's average of the
// step's gradients, on every replica alike.
//  - DDP (ddp_stage_sync): the reducer is prepared right before the last
//    backward (torch.distributed.pipelining does the same), so its buckets are
//    all-reduced as they fill and its end-of-backward callback waits for them.
//    parameters() are the module's (layout Replicate over the data group).
//  - ZeRO (zero_stage_sync, stages 1-3): sync is re-enabled before the last
//    backward, whose end-of-backward callback completes the per-unit
//    reduce-scatters into this rank's shards; parameters() are those shards
//    (layout Shard over the data group). That callback ends the first autograd
//    run after sync is on, so the last backward must be one run: the last W of
//    a zero-bubble schedule, which otherwise runs the engine once per captured
//    intermediate (split_backward.h), becomes one backward from the stage's
//    output restricted to the parameters (recomputing the input path once per
//    step). Stage 3 all-gathers the stage's parameters once, at begin_step,
//    keeps them gathered across the step's micro-batches (torchtitan turns
//    reshard_after_forward off under pipelining for the same reason: the
//    micro-batches would gather every unit twice each) and frees them at
//    end_step; stages 1-2 all-gather the updated chunks at the first forward
//    after an optimizer step.
//  - All-reduce (allreduce_stage_sync): nothing during the schedule; one
//    coalesced all-reduce of the stage's gradients at end_step (the baseline
//    without overlap).
//  - Local (no data group, or one of size 1): the module alone.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"

namespace dtrain::pipeline {

class StageGradientSync {
 public:
  virtual ~StageGradientSync() = default;

  // See the Note. begin_step and end_step come in pairs, once per step or
  // evaluation; forward and before_last_backward between them.
  virtual void begin_step(bool training) = 0;
  virtual at::Tensor forward(const at::Tensor& input) = 0;
  virtual bool before_last_backward() = 0;
  virtual void end_step() = 0;

  // Makes the module's full parameters current (after an optimizer step
  // changed the shards) and keeps them so until end_step(); call after
  // begin_step(). For readers of whole parameters (a tied weight sent to the
  // stage that borrows it).
  virtual void gather_parameters() {}

  // The tensors the optimizer steps on for the stage's module parameters.
  virtual std::vector<at::Tensor> parameters() const = 0;
  // Whether parameters() are parts of the module's parameters split over the
  // data group (a Shard layout: global norms then combine over it, and a
  // module parameter's gradient is not what the optimizer reads) rather than
  // the module's parameters themselves (Replicate).
  virtual bool sharded() const = 0;
  // Adds `grad` (the full gradient of module parameter `param`, already
  // averaged over the data group) to what the optimizer steps on for it.
  virtual void add_gradient(const at::Tensor& param, const at::Tensor& grad) = 0;
  // Clears every gradient parameters() steps on (and any full gradients kept).
  virtual void zero_grad() = 0;

  // The ZeRO engine sharding this stage, or null: for checkpoints and for
  // scopes that need the full parameters (ShardedDataParallel::full_parameters).
  virtual ShardedDataParallel* zero_engine() { return nullptr; }
};

// Builds a stage's sync from its module and the data-parallel group (absent
// or of size 1: Local). Collective over the data group (DDP's model check
// and broadcast, ZeRO's layout): every replica builds its stages in the same
// order.
using StageSyncFactory = std::function<std::unique_ptr<StageGradientSync>(
    torch::nn::Sequential module, const std::optional<dist::ProcessGroup>& data_group)>;

// DDP per stage. find_unused_parameters and static_graph are refused (every
// stage uses all its parameters in every micro-batch).
StageSyncFactory ddp_stage_sync(DDPOptions options = {});
// ZeRO per stage over the data group (the mesh's dp_shard), stage 1, 2 or 3.
// `sequential` must stay empty: a stage's module is the Sequential run.
StageSyncFactory zero_stage_sync(ZeroOptions options);
// One coalesced all-reduce of the stage's gradients after the schedule.
StageSyncFactory allreduce_stage_sync();

// The factory for a name as the examples' --dp-reduce spells it: "ddp",
// "zero1", "zero2", "zero3" or "allreduce"; ConfigError for anything else.
StageSyncFactory stage_sync_named(const std::string& name);

}  // namespace dtrain::pipeline
