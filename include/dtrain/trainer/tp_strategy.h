// Tensor parallelism through the Trainer: a module whose layers are split
// over the mesh's `tp` dimension (nn::ColumnParallelLinear and the others,
// their parameters carrying layouts), optionally replicated over
// `dp_replicate` with DDP over that dimension's group, and optionally
// splitting every sequence over `cp` as well (its attention over cp inside
// each tp coordinate), DDP then averaging over dp_replicate x cp.
//
//   auto mesh = std::make_shared<dist::DeviceMesh>(world, {{"dp_replicate", 2}, {"tp", 2}});
//   auto model = gpt::apply_tp(gpt::gpt_layers(config), *mesh);  // any tp-split module
//   auto s = std::make_shared<TensorParallelStrategy<torch::nn::Sequential>>(model, mesh, device);
//
// Contracts:
//  - the mesh has `tp`, and besides it only `dp_replicate` and `cp` (ZeRO
//    and pipelines compose with tp through ShardedDataParallel's and
//    Pipeline's own mesh options: dtrain::parallelize);
//  - the data rank and world are the dp_replicate coordinate and size: every
//    rank of a tp (and cp) group reads the same batch; under cp the module
//    keeps its own rows of each sequence and cut_targets() cuts the targets
//    alike, the loss's value averaged over cp (nn::cp::mean_loss);
//  - gradients are averaged over the dp_replicate x cp group only (DDP),
//    never over tp: the tp layers' own communication already makes each
//    rank's gradient of its part complete;
//  - the global gradient norm counts each element once: squares of
//    parameters sharded on tp are summed over the tp group, replicated ones
//    are counted on tp rank 0 only (their gradients are equal on every tp
//    rank), read from dist::named_layouts; every rank's gradients, replicated
//    ones included, are then scaled alike;
//  - GradScaler found-inf flags are combined over the whole mesh;
//  - the loss must be the tp one (e.g. vocab-parallel cross-entropy): it is
//    collective over tp, as are forward and backward;
//  - checkpoints: every rank saves its parameters and optimizer state with
//    their layouts, laid out (kLaidOutState, the format of one process, DDP
//    and pipelines; names set_checkpoint_prefix + the module's); loading
//    under another tp degree, dp_replicate size or plan fills each rank's
//    parts from the saved boxes that meet them (trainer/resharding.h); tp
//    checkpoints saved before (state "tp") still load. The mesh must outlive
//    the Checkpointer's use of it.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/checkpoint/layout_state.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "dtrain/trainer/resharding.h"
#include "dtrain/trainer/strategy.h"

namespace dtrain {

template <typename Holder>
class TensorParallelStrategy : public Strategy {
 public:
  // `module` holds this rank's parts (its tp layers built on `mesh`); DDP
  // over dp_replicate when the mesh has it (collective there: parameters are
  // broadcast from the group's first rank).
  TensorParallelStrategy(Holder module, std::shared_ptr<dist::DeviceMesh> mesh, c10::Device device,
                         const DDPOptions& options = {})
      : module_(module), mesh_(std::move(mesh)), device_(device), bucket_views_(options.gradient_as_bucket_view) {
    DTRAIN_CHECK(mesh_->has("tp"), ConfigError,
                 "TensorParallelStrategy needs a mesh with a tp dimension; this one is " << mesh_->describe() << ".",
                 "build the mesh with {\"tp\", degree}");
    for (const auto& d : mesh_->dims())
      DTRAIN_CHECK(d.name == "tp" || d.name == "dp_replicate" || d.name == "cp", ConfigError,
                   "TensorParallelStrategy composes tp with dp_replicate and cp; the mesh has " << d.name << ".",
                   "put the data-parallel ranks on dp_replicate (DDP), or shard with ShardedDataParallel's mesh");
    if (mesh_->size("cp") > 1) {
      ddp_ = std::make_unique<DistributedDataParallel<Holder>>(
          std::move(module), mesh_->join({"dp_replicate", "dp_shard", "cp"}), options);
    } else if (mesh_->size("dp_replicate") > 1) {
      ddp_ = std::make_unique<DistributedDataParallel<Holder>>(std::move(module), (*mesh_)["dp_replicate"], options);
    }
  }
  std::string name() const override { return "tp"; }
  torch::nn::Module& module() override { return *detail::as_module_ptr(module_); }
  c10::Device input_device() const override { return device_; }
  c10::Device output_device() const override { return device_; }
  at::Tensor forward(const at::Tensor& input) override {
    return ddp_ ? (*ddp_)(input) : at::Tensor(module_->forward(input));
  }
  at::Tensor eval_forward(const at::Tensor& input) override { return module_->forward(input); }
  std::unique_ptr<Scope> no_sync() override {
    if (!ddp_) return nullptr;
    struct Guard : Scope {
      explicit Guard(DistributedDataParallel<Holder>& ddp) : guard(ddp.no_sync()) {}
      NoSync guard;
    };
    return std::make_unique<Guard>(*ddp_);
  }
  void zero_grad(torch::optim::Optimizer& optimizer) override {
    if (ddp_ && bucket_views_) {
      ddp_->zero_grad();
    } else {
      optimizer.zero_grad();
    }
  }
  // From the parameters' layouts: sharded on tp, summed over tp; replicated,
  // counted on tp rank 0 (dp_replicate holds equal copies after DDP) and
  // clipped alike on every rank (GradientSet::counted_elsewhere), so
  // Strategy::clip_grad_norm needs nothing of its own.
  GradientSet gradients() override {
    const auto params = module().named_parameters();
    std::vector<std::pair<at::Tensor, dist::Layout>> laid_out;
    for (auto& [name, layout] : dist::named_layouts(module(), *mesh_)) laid_out.emplace_back(params[name], layout);
    return GradientSet::from_layouts(laid_out, *mesh_);
  }
  std::optional<dist::ProcessGroup> found_inf_group() override { return mesh_->group(); }
  int data_rank() const override { return mesh_->coordinate("dp_replicate"); }
  int data_world() const override { return mesh_->size("dp_replicate"); }
  std::optional<dist::ProcessGroup> group() override { return mesh_->group(); }
  void save(Checkpointer& checkpointer, const TrainingState& state, torch::optim::Optimizer& optimizer) override {
    register_saved_state(checkpointer, kLaidOutState, laid_out(optimizer));
    checkpointer.save(state);
  }
  // Any plan's checkpoint (laid out or ZeRO shards), and tp checkpoints
  // saved before they were laid out (state "tp", the module's own names).
  std::optional<TrainingState> load(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer) override {
    if (saved_model_state(checkpointer) == SavedModelState::kTensorParallel) {
      checkpointer.remove_state(kLaidOutState);
      register_saved_state(checkpointer, kTensorParallelState, layout_state(module(), *mesh_, &optimizer));
      struct Remove {
        Checkpointer& c;
        ~Remove() { c.remove_state(kTensorParallelState); }
      } remove{checkpointer};
      return checkpointer.load_latest();
    }
    const std::shared_ptr<LayoutState> mine = laid_out(optimizer);
    return load_any_plan(checkpointer, {.laid_out = mine, .zero = zero_reader(mine)}, name());
  }
  dist::DeviceMesh& mesh() { return *mesh_; }
  // Checkpoints name the parameters `prefix` + their names in the module:
  // the whole model's names under every other plan (parallelize's "layers."),
  // so they reshard to and from those plans. Default: the module's names.
  void set_checkpoint_prefix(std::string prefix) {
    checkpoint_prefix_ = std::move(prefix);
    laid_out_ = nullptr;
  }

 private:
  std::shared_ptr<LayoutState> laid_out(torch::optim::Optimizer& optimizer) {
    if (!laid_out_ || laid_out_optimizer_ != &optimizer) {
      laid_out_ = layout_state(module(), *mesh_, &optimizer, checkpoint_prefix_);
      laid_out_optimizer_ = &optimizer;
    }
    return laid_out_;
  }

  Holder module_;
  std::shared_ptr<dist::DeviceMesh> mesh_;
  c10::Device device_;
  bool bucket_views_;
  std::unique_ptr<DistributedDataParallel<Holder>> ddp_;
  std::string checkpoint_prefix_;
  std::shared_ptr<LayoutState> laid_out_;
  torch::optim::Optimizer* laid_out_optimizer_ = nullptr;
};

}  // namespace dtrain
