// Tensor parallelism on tp (the model's split), DDP over dp_replicate.
#include "appliers.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "dtrain/trainer/tp_strategy.h"
#include "released_parameters.h"

namespace dtrain::detail {

namespace {

// Copies the parameters of `split` into `full` (same names), each assembled
// through its layout: every rank writes its part into a zero tensor of the
// global shape and the parts are summed over tp (disjoint, so exactly).
// Collective over mesh["tp"]; every tp rank ends with the full weights.
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

}  // namespace

Parallelized apply_tp(const ApplyContext& c) {
  const auto& tp = c.parts.tp;
  DTRAIN_CHECK(tp.split && tp.loss, ConfigError,
               "the plan splits the model over tp " << c.plan.tp << ", but the model gives no tensor-parallel split.",
               "set ModelParts::tp (split and loss), or plan tp 1");
  const c10::Device first = c.device();
  auto mesh = std::make_shared<dist::DeviceMesh>(c.group(), c.plan.mesh_dims());
  // The full layers stay (on the CPU, released while training) to assemble
  // the trained weights into.
  // The split is trained under the Sequential's own names ("0.wte.weight"),
  // not under parts.name: tp checkpoints (state "tp") keep the names they
  // had before parallelize, so those saved earlier still load.
  torch::nn::Sequential full = c.parts.layers();
  LayerStack split(tp.split(full, *mesh), "", c.parts.retie);
  const auto unshared = ReleasedParameters::release(*full, identities(split->parameters()));  // until full_weights()
  split->to(first);
  auto strategy = std::make_shared<TensorParallelStrategy<LayerStack>>(split, mesh, first, c.options.ddp);
  LayerStack whole = c.stack(full);
  Parallelized r = trained_module_is_whole(strategy, whole.ptr(), forward_on(whole, c10::kCPU));
  r.mesh = mesh;
  r.loss = tp.loss(*mesh);
  r.full_weights = [split, mesh, whole, unshared]() mutable -> std::unique_ptr<Strategy::Scope> {
    auto scope = unshared->rematerialize();
    assemble_by_layouts(*split, *mesh, *whole->layers);  // both under the Sequential's names
    return scope;
  };
  return r;
}

}  // namespace dtrain::detail
