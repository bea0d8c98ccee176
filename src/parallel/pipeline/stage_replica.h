// How one pipeline stage's gradients are averaged over its data-parallel
// group (DP x PP), private to the pipeline executor: the stage's module
// wrapped by DistributedDataParallel or ShardedDataParallel, driven the way a
// pipeline needs (see StageReduction in pipeline.h).
//
// Note [Stage gradients over the data-parallel group]
// A stage runs m forwards and m backwards per step. Only the last backward
// that reaches its parameters (B or W of its last micro-batch, per the
// rank's action list) reduces; the others accumulate locally, as under
// no_sync. DDP: the reducer is prepared right before that backward
// (torch.distributed.pipelining does the same), so its buckets are
// all-reduced as they fill and its end-of-backward callback waits for them.
// Sharded (ZeRO 1-2): sync is re-enabled before that backward, whose
// end-of-backward callback completes the reduce-scatters. That callback ends
// the first autograd run after sync is on, so this backward must be one run:
// the last W of a zero-bubble schedule, which otherwise runs the engine once
// per captured intermediate (split_backward.h), becomes one backward from the
// stage's output restricted to the parameters (recomputing the input path
// once per step).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <optional>
#include <vector>

#include "dtrain/parallel/ddp/ddp.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"

namespace dtrain::pipeline::detail {

class StageReplica {
 public:
  // Collective over `group` (DDP's model check and broadcast, sharding's
  // layout): every replica builds its stage replicas in the same order.
  // Only for kDDP and kSharded (kAllReduce needs no replica).
  StageReplica(torch::nn::Sequential module, dist::ProcessGroup group, const PipelineOptions& options);
  ~StageReplica();
  StageReplica(const StageReplica&) = delete;
  StageReplica& operator=(const StageReplica&) = delete;

  // Forward of one micro-batch; `first` marks the stage's first forward of a
  // training step (gradient sync is then switched off until last_backward()).
  at::Tensor forward(const at::Tensor& input, bool first);
  // Call right before the backward that completes the stage's gradients for
  // this step.
  void last_backward();
  // Whether that backward must be one autograd run (sharded: see the Note).
  bool needs_single_run() const { return sharded_ != nullptr; }

  ShardedDataParallel* sharded() { return sharded_.get(); }
  void zero_grad();

 private:
  torch::nn::Sequential module_;
  std::unique_ptr<dtrain::detail::DDPEngine> ddp_;
  std::unique_ptr<ShardedDataParallel> sharded_;
  std::optional<ShardedDataParallel::NoSync> sharded_no_sync_;
};

}  // namespace dtrain::pipeline::detail
