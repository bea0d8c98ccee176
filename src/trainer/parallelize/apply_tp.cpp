// Tensor parallelism on tp (the model's split; with cp, of every sequence
// too), ZeRO over dp_shard (x cp) or DDP over dp_replicate (x cp).
#include "appliers.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/tp_strategy.h"
#include "dtrain/trainer/zero_strategy.h"
#include "released_parameters.h"

namespace dtrain::detail {

// Every rank writes its part into a zero tensor of the global shape and the
// parts are summed over tp (disjoint, so exactly).
void assemble_by_layouts(torch::nn::Module& split, dist::DeviceMesh& mesh, torch::nn::Module& full) {
  torch::NoGradGuard no_grad;
  const auto params = split.named_parameters();
  auto full_params = full.named_parameters();
  dist::ProcessGroup& tp = mesh["tp"];
  for (const auto& [name, layout] : dist::named_layouts(split, mesh)) {
    const at::Tensor& part = params[name];
    at::Tensor& target = full_params[name];
    bool replicated = true;
    for (const auto& placement : layout.placements)
      replicated = replicated && placement.kind == dist::Placement::Kind::kReplicate;
    if (replicated) {
      target.copy_(part);
      continue;
    }
    at::Tensor global = at::zeros(layout.global_shape, part.options());
    at::Tensor mine = dist::local_part(global, layout, mesh.coordinates());
    mine.copy_(part.detach().reshape(mine.sizes()));
    tp.all_reduce(global).wait();
    target.copy_(global.view(target.sizes()));
  }
}

Parallelized apply_tp(const ApplyContext& c) {
  const c10::Device first = c.device();
  auto mesh = std::make_shared<dist::DeviceMesh>(c.group(), c.plan.mesh_dims());
  SplitModel m = split_model(c, *mesh);
  std::shared_ptr<Strategy> strategy;
  std::shared_ptr<ShardedDataParallel> sdp;
  // Trained under the Sequential's own names ("embed.wte.weight") and, beside
  // DDP, checkpointed under the whole model's (parts.name + "."), so tp
  // checkpoints reshard to and from every other plan. ZeRO holds it under
  // parts.name, where ModelParts::zero_unit names units and its checkpoints
  // name the parameters as the whole model does.
  LayerStack split(m.trained, "", c.parts.retie);
  if (c.plan.dp_shard > 1) {
    split = c.stack(m.trained);
    std::shared_ptr<torch::nn::Module> root = split.ptr();
    if (c.parts.name.empty()) root = m.trained.ptr();
    sdp = shard_with_zero(c, root, c.parts.name, mesh.get());
    strategy = std::make_shared<ZeroStrategy>(sdp, first);
  } else {
    auto tp = std::make_shared<TensorParallelStrategy<LayerStack>>(split, mesh, first, c.options.ddp);
    tp->set_checkpoint_prefix(c.parts.name.empty() ? "" : c.parts.name + ".");
    strategy = tp;
  }
  if (m.targets) strategy->cut_targets(m.targets);
  LayerStack whole = c.stack(m.full);
  Parallelized r = trained_module_is_whole(strategy, whole.ptr(), forward_on(whole, c10::kCPU));
  r.mesh = mesh;
  r.loss = m.loss;
  if (sdp) {
    r.is_matrix = shards_of_matrices({sdp.get()});
    r.keep.push_back(sdp);
  }
  r.full_weights = [strategy, layers = m.trained, mesh, whole,
                    unshared = m.unshared]() mutable -> std::unique_ptr<Strategy::Scope> {
    std::unique_ptr<Strategy::Scope> scope = unshared->rematerialize();             // whole's storage, until it ends
    const std::unique_ptr<Strategy::Scope> gathered = strategy->full_parameters();  // ZeRO's shards
    assemble_by_layouts(*layers, *mesh, *whole->layers);                            // both under the Sequential's names
    return scope;
  };
  return r;
}

}  // namespace dtrain::detail
