// Private to parallelize: what every applier shares (the context it is
// called with, the module that holds a model's layers, the common parts of
// a result), and the appliers themselves, one file each.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/error.h"
#include "dtrain/trainer/parallelize.h"
#include "released_parameters.h"

namespace dtrain {
class ShardedDataParallel;
}

namespace dtrain::detail {

// The module a model's layers are trained as: the Sequential registered
// under `name` (its parameters "name.<layer>...."), or, with no name, its
// layers registered directly (the Sequential's own names). Forward runs the
// layers in order. clone() deep-copies the layers and calls `retie` on the
// copy (DataParallel's replicas).
class LayerStackImpl : public torch::nn::Module {
 public:
  LayerStackImpl(torch::nn::Sequential layers, std::string name,
                 std::function<void(torch::nn::Sequential&)> retie = nullptr);
  at::Tensor forward(const at::Tensor& x) { return layers->forward(x); }
  std::shared_ptr<torch::nn::Module> clone(const std::optional<c10::Device>& device = std::nullopt) const override;

  torch::nn::Sequential layers;

 private:
  std::string name_;
  std::function<void(torch::nn::Sequential&)> retie_;
};
TORCH_MODULE(LayerStack);

struct ApplyContext {
  const ModelParts& parts;
  const ParallelPlan& plan;
  std::optional<dist::ProcessGroup> world;
  const ParallelizeOptions& options;

  c10::Device device() const { return options.devices.empty() ? c10::Device(c10::kCPU) : options.devices.front(); }
  std::vector<c10::Device> devices() const {
    return options.devices.empty() ? std::vector<c10::Device>{c10::kCPU} : options.devices;
  }
  // The run's group (every applier but the one-process one needs it).
  dist::ProcessGroup& group() const {
    DTRAIN_CHECK(world.has_value(), ConfigError,
                 "the plan (" << plan.world() << " ranks, ZeRO stage " << plan.zero_stage
                              << ") needs the run's process group, and none was given.",
                 "pass the world group to parallelize (dist::init_process_group())");
    return const_cast<dist::ProcessGroup&>(*world);
  }
  bool lead() const { return !world || world->rank() == 0; }
  LayerStack stack(torch::nn::Sequential layers) const {
    return LayerStack(std::move(layers), parts.name, parts.retie);
  }
  ModelLossFn loss() const;
};

// A result whose `whole` is the trained module itself: its full weights are
// in it (inside the strategy's full_parameters() scope where sharded), its
// matrices have 2+ dimensions.
Parallelized trained_module_is_whole(std::shared_ptr<Strategy> strategy, std::shared_ptr<torch::nn::Module> whole,
                                     std::function<at::Tensor(const at::Tensor&)> forward_whole);
// is_matrix over ZeRO's shards: decided on each shard's full parameter.
std::function<bool(const at::Tensor&)> shards_of_matrices(const std::vector<ShardedDataParallel*>& sharded);
// Forward of `module`'s layers with inputs moved to `device`.
std::function<at::Tensor(const at::Tensor&)> forward_on(LayerStack module, c10::Device device);

// The model as this rank trains it under the plan's tp and cp, before the
// pipeline or a data-parallel applier wraps it (split_model.cpp): the
// model's tensor-parallel split (ModelParts::tp; with cp > 1 as well, the
// split also cuts every sequence over mesh["cp"]), its context-parallel
// view (ModelParts::cp), or the layers themselves.
struct SplitModel {
  // Every layer of the whole model: `trained` itself or what its modules
  // are shared with (cp), or, under tp, the unsplit copy (on the CPU) that
  // full_weights() assembles the trained parts into.
  torch::nn::Sequential full;
  torch::nn::Sequential trained;  // this rank's layers, on the context's device
  bool tensor_parallel = false;   // `trained` holds tp parts (own parameters)
  ModelLossFn loss;               // of trained's outputs
  // The rows of a [B, T] target that trained's outputs hold (cp); null: all.
  std::function<at::Tensor(const at::Tensor&)> targets;
  // Under tp, `full`'s parameters (none shared with `trained`), released
  // while training; rematerialised for full_weights() (released_parameters.h).
  std::shared_ptr<ReleasedParameters> unshared;
};
// `mesh` (the plan's) must outlive the result's loss and targets.
SplitModel split_model(const ApplyContext& c, dist::DeviceMesh& mesh);
// Copies the parameters of `split` (tp parts) into `full` (same names), each
// assembled through its layout. Collective over mesh["tp"]; every tp rank
// ends with the full weights (apply_tp.cpp).
void assemble_by_layouts(torch::nn::Module& split, dist::DeviceMesh& mesh, torch::nn::Module& full);
// ZeRO at the plan's stage over `root` (running the Sequential `sequential`
// in it, ModelParts::zero_unit's units): over dp_shard (HSDP with
// dp_replicate); with a mesh whose parameters are laid out over it (tp, or
// cp whose ranks the sharding group then spans: ZeroOptions::shard_dims),
// over mesh.join(shard dims) (apply_zero.cpp).
std::shared_ptr<ShardedDataParallel> shard_with_zero(const ApplyContext& c, std::shared_ptr<torch::nn::Module> root,
                                                     const std::string& sequential, dist::DeviceMesh* mesh);

struct Applier {
  const char* name;
  bool (*handles)(const ParallelPlan& plan);
  Parallelized (*apply)(const ApplyContext& context);
};

// One per axis, in the order parallelize tries them (parallelize.cpp).
Parallelized apply_pipeline(const ApplyContext& c);  // pp > 1 (stages of the tp/cp split)
Parallelized apply_tp(const ApplyContext& c);        // tp > 1 (ZeRO or DDP over the rest)
Parallelized apply_cp(const ApplyContext& c);        // cp > 1 (ZeRO or DDP over the rest)
Parallelized apply_zero(const ApplyContext& c);      // dp_shard > 1 (HSDP with dp_replicate)
Parallelized apply_ddp(const ApplyContext& c);       // dp_replicate > 1
Parallelized apply_local(const ApplyContext& c);     // one process: one device, DataParallel, ModelParallel

}  // namespace dtrain::detail
