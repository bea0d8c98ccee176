// See Note [Stage gradients over the data-parallel group] in stage_replica.h.
#include "stage_replica.h"

#include "dtrain/error.h"

namespace dtrain::pipeline::detail {

StageReplica::StageReplica(torch::nn::Sequential module, dist::ProcessGroup group, const PipelineOptions& options)
    : module_(std::move(module)) {
  switch (options.data_parallel_reduction) {
    case StageReduction::kDDP:
      DTRAIN_CHECK(!options.ddp.find_unused_parameters && !options.ddp.static_graph, ConfigError,
                   "pipeline stages do not support DDPOptions::find_unused_parameters or static_graph",
                   "leave both off: every stage uses all its parameters in every micro-batch");
      ddp_ = std::make_unique<dtrain::detail::DDPEngine>(module_.ptr(), std::move(group), options.ddp);
      break;
    case StageReduction::kSharded:
      DTRAIN_CHECK(options.zero.stage == 1 || options.zero.stage == 2, ConfigError,
                   "pipeline stages are sharded with ZeRO stage 1 or 2, not " << options.zero.stage,
                   "set PipelineOptions::zero.stage to 1 or 2 (stage 3 would gather every unit once per "
                   "micro-batch)");
      DTRAIN_CHECK(options.zero.sequential.empty(), ConfigError,
                   "PipelineOptions::zero.sequential must stay empty: a stage's module is the Sequential run",
                   "leave it unset");
      sharded_ = std::make_unique<ShardedDataParallel>(module_.ptr(), std::move(group), options.zero);
      break;
    case StageReduction::kAllReduce:
      DTRAIN_INTERNAL_ASSERT(false, "kAllReduce stages have no replica: the pipeline all-reduces them itself");
  }
}

StageReplica::~StageReplica() = default;

at::Tensor StageReplica::forward(const at::Tensor& input, bool first) {
  if (sharded_) {
    if (first && at::GradMode::is_enabled() && !sharded_no_sync_) sharded_no_sync_.emplace(*sharded_);
    return sharded_->forward(input);
  }
  if (ddp_ && first && at::GradMode::is_enabled()) {
    // Sync on for pre_forward's per-iteration bookkeeping (as one DDP
    // forward), then off until the last backward.
    ddp_->set_require_backward_grad_sync(true);
    ddp_->pre_forward();
    ddp_->set_require_backward_grad_sync(false);
  }
  return module_->forward(input);
}

void StageReplica::last_backward() {
  if (sharded_) {
    sharded_no_sync_.reset();
  } else if (ddp_) {
    ddp_->set_require_backward_grad_sync(true);
    ddp_->post_forward({});  // prepares the reducer for the next backward
  }
}

void StageReplica::zero_grad() {
  if (sharded_) {
    sharded_->zero_grad();
  } else {
    ddp_->zero_grad(/*set_to_none=*/true);
  }
}

}  // namespace dtrain::pipeline::detail
