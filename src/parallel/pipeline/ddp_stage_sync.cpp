// The DDP applier of a pipeline stage: bucketed all-reduce over the data
// group, overlapped with the stage's last backward of a step (Note [Stage
// gradients over the data-parallel group] in
// include/dtrain/parallel/pipeline/stage_sync.h).
#include "dtrain/error.h"
#include "dtrain/parallel/pipeline/stage_sync.h"
#include "stage_sync_detail.h"

namespace dtrain::pipeline {

namespace {

class DDPStageSync : public StageGradientSync {
 public:
  DDPStageSync(torch::nn::Sequential module, dist::ProcessGroup group, const DDPOptions& options)
      : module_(std::move(module)), ddp_(module_.ptr(), std::move(group), options) {}

  void begin_step(bool training) override {
    if (!training || !at::GradMode::is_enabled()) return;
    // Sync on for pre_forward's per-iteration bookkeeping (as one DDP
    // forward), then off until the last backward.
    ddp_.set_require_backward_grad_sync(true);
    ddp_.pre_forward();
    ddp_.set_require_backward_grad_sync(false);
  }
  at::Tensor forward(const at::Tensor& input) override { return module_->forward(input); }
  bool before_last_backward() override {
    ddp_.set_require_backward_grad_sync(true);
    ddp_.post_forward({});  // prepares the reducer for the next backward
    return false;
  }
  void end_step() override {}
  std::vector<at::Tensor> parameters() const override { return detail::trainable_parameters(module_); }
  bool sharded() const override { return false; }
  void add_gradient(const at::Tensor& param, const at::Tensor& grad) override { param.mutable_grad().add_(grad); }
  void zero_grad() override { ddp_.zero_grad(/*set_to_none=*/true); }

 private:
  torch::nn::Sequential module_;
  dtrain::detail::DDPEngine ddp_;
};

}  // namespace

StageSyncFactory ddp_stage_sync(DDPOptions options) {
  DTRAIN_CHECK(!options.find_unused_parameters && !options.static_graph, ConfigError,
               "pipeline stages do not support DDPOptions::find_unused_parameters or static_graph",
               "leave both off: every stage uses all its parameters in every micro-batch");
  return [options](torch::nn::Sequential module, const std::optional<dist::ProcessGroup>& group) {
    if (!group || group->size() < 2) return detail::local_stage_sync(std::move(module));
    return std::unique_ptr<StageGradientSync>(std::make_unique<DDPStageSync>(std::move(module), *group, options));
  };
}

}  // namespace dtrain::pipeline
