// The stage syncs without an engine of their own (Local, All-reduce) and the
// examples' names for all of them; see Note [Stage gradients over the
// data-parallel group] in include/dtrain/parallel/pipeline/stage_sync.h.
#include "dtrain/parallel/pipeline/stage_sync.h"
#include "stage_sync_detail.h"

#include "dtrain/error.h"

namespace dtrain::pipeline {

namespace {

// The module's own parameters, stepped as they are: no data group (Local), or
// averaged by one coalesced all-reduce after the schedule (All-reduce).
class ReplicatedStageSync : public StageGradientSync {
 public:
  ReplicatedStageSync(torch::nn::Sequential module, std::optional<dist::ProcessGroup> group)
      : module_(std::move(module)), group_(std::move(group)) {}

  void begin_step(bool training) override { training_ = training; }
  at::Tensor forward(const at::Tensor& input) override { return module_->forward(input); }
  bool before_last_backward() override { return false; }
  void end_step() override {
    if (!group_ || !training_) return;
    std::vector<at::Tensor> grads;
    for (const at::Tensor& param : parameters()) {
      if (!param.grad().defined()) param.mutable_grad() = at::zeros_like(param);
      grads.push_back(param.grad());
    }
    if (!grads.empty()) group_->all_reduce_coalesced(grads, dist::ReduceOp::kAvg).wait();
  }
  std::vector<at::Tensor> parameters() const override { return detail::trainable_parameters(module_); }
  bool sharded() const override { return false; }
  void add_gradient(const at::Tensor& param, const at::Tensor& grad) override { param.mutable_grad().add_(grad); }
  void zero_grad() override {
    for (at::Tensor& param : module_->parameters()) param.mutable_grad() = at::Tensor();
  }

 private:
  torch::nn::Sequential module_;
  std::optional<dist::ProcessGroup> group_;  // set: All-reduce
  bool training_ = false;
};

}  // namespace

// Local: also what every factory builds without a data group of 2+ ranks.
namespace detail {

std::unique_ptr<StageGradientSync> local_stage_sync(torch::nn::Sequential module) {
  return std::make_unique<ReplicatedStageSync>(std::move(module), std::nullopt);
}

std::vector<at::Tensor> trainable_parameters(const torch::nn::Sequential& module) {
  std::vector<at::Tensor> params;
  for (const at::Tensor& param : module->parameters()) {
    if (param.requires_grad()) params.push_back(param);
  }
  return params;
}

}  // namespace detail

StageSyncFactory allreduce_stage_sync() {
  return [](torch::nn::Sequential module, const std::optional<dist::ProcessGroup>& group) {
    if (!group || group->size() < 2) return detail::local_stage_sync(std::move(module));
    return std::unique_ptr<StageGradientSync>(std::make_unique<ReplicatedStageSync>(std::move(module), group));
  };
}

StageSyncFactory stage_sync_named(const std::string& name) {
  if (name == "ddp") return ddp_stage_sync();
  if (name == "zero1" || name == "zero2" || name == "zero3") return zero_stage_sync({.stage = name.back() - '0'});
  DTRAIN_CHECK(name == "allreduce", ConfigError, "unknown data-parallel reduction '" << name << "' for pipeline stages",
               "use ddp, zero1, zero2, zero3 or allreduce");
  return allreduce_stage_sync();
}

}  // namespace dtrain::pipeline
