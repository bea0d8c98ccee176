// The ZeRO applier of a pipeline stage (stages 1-3): reduce-scatter over the
// data group (dp_shard) during the stage's last backward of a step; stage 3
// gathers the stage's parameters once per step and frees them at its end
// (Note [Stage gradients over the data-parallel group] in
// include/dtrain/parallel/pipeline/stage_sync.h).
#include "dtrain/error.h"
#include "dtrain/parallel/pipeline/stage_sync.h"
#include "stage_sync_detail.h"

namespace dtrain::pipeline {

namespace {

class ZeroStageSync : public StageGradientSync {
 public:
  ZeroStageSync(torch::nn::Sequential module, dist::ProcessGroup group, const ZeroOptions& options)
      : sdp_(module.ptr(), std::move(group), options) {}

  void begin_step(bool training) override {
    if (training && at::GradMode::is_enabled()) no_sync_.emplace(sdp_);
    if (sdp_.options().stage == 3) full_.emplace(sdp_);  // gathered until end_step
  }
  at::Tensor forward(const at::Tensor& input) override { return sdp_.forward(input); }
  bool before_last_backward() override {
    no_sync_.reset();
    return true;  // its end-of-backward callback completes the reductions: one autograd run
  }
  void end_step() override {
    no_sync_.reset();
    full_.reset();  // stage 3: resharded
  }
  void gather_parameters() override {
    if (!full_) sdp_.pre_forward();  // stages 1-2; stage 3 is gathered from begin_step on
  }
  std::vector<at::Tensor> parameters() const override { return sdp_.parameters(); }
  bool sharded() const override { return true; }
  // `grad`'s elements in this rank's chunk go to the shards' pieces of `param`.
  void add_gradient(const at::Tensor& param, const at::Tensor& grad) override {
    const at::Tensor flat = grad.flatten();
    for (const ParameterShard& piece : sdp_.parameter_shards()) {
      if (!piece.parameter.is_same(param)) continue;
      at::Tensor part = flat.narrow(0, piece.offset, piece.shard.numel()).to(piece.shard.scalar_type());
      if (piece.shard.grad().defined()) {
        piece.shard.mutable_grad().add_(part);
      } else {
        piece.shard.mutable_grad() = part.clone();
      }
    }
  }
  void zero_grad() override { sdp_.zero_grad(); }
  ShardedDataParallel* zero_engine() override { return &sdp_; }

 private:
  ShardedDataParallel sdp_;
  std::optional<ShardedDataParallel::NoSync> no_sync_;
  std::optional<ShardedDataParallel::FullParameters> full_;
};

}  // namespace

StageSyncFactory zero_stage_sync(ZeroOptions options) {
  DTRAIN_CHECK(options.stage >= 1 && options.stage <= 3, ConfigError,
               "pipeline stages are sharded with ZeRO stage 1, 2 or 3, not " << options.stage,
               "set the ZeRO stage to 1, 2 or 3");
  DTRAIN_CHECK(options.sequential.empty(), ConfigError,
               "ZeroOptions::sequential must stay empty for pipeline stages: a stage's module is the Sequential run",
               "leave it unset");
  return [options](torch::nn::Sequential module, const std::optional<dist::ProcessGroup>& group) {
    if (!group || group->size() < 2) return detail::local_stage_sync(std::move(module));
    return std::unique_ptr<StageGradientSync>(std::make_unique<ZeroStageSync>(std::move(module), *group, options));
  };
}

}  // namespace dtrain::pipeline
