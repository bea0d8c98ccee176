// Context parallelism on cp (the model's split of every sequence), DDP over
// dp_replicate x cp.
#include "appliers.h"
#include "dtrain/error.h"
#include "dtrain/trainer/cp_strategy.h"

namespace dtrain::detail {

Parallelized apply_cp(const ApplyContext& c) {
  const auto& cp = c.parts.cp;
  DTRAIN_CHECK(cp.split && cp.targets && cp.loss, ConfigError,
               "the plan splits sequences over cp " << c.plan.cp << ", but the model gives no context-parallel split.",
               "set ModelParts::cp (split, targets and loss), or plan cp 1");
  const c10::Device first = c.device();
  auto mesh = std::make_shared<dist::DeviceMesh>(c.group(), c.plan.mesh_dims());
  // The cp view shares the full layers' modules: they hold the full weights.
  torch::nn::Sequential full = c.parts.layers();
  full->to(first);
  LayerStack split = c.stack(cp.split(full, *mesh));
  dist::DeviceMesh* m = mesh.get();
  auto strategy = std::make_shared<ContextParallelStrategy<LayerStack>>(
      split, mesh, first, [targets = cp.targets, m](const at::Tensor& t) { return targets(t, *m); }, c.options.ddp);
  LayerStack whole = c.stack(full);
  Parallelized r = trained_module_is_whole(strategy, whole.ptr(), forward_on(whole, first));
  r.mesh = mesh;
  r.loss = cp.loss(*mesh);
  return r;
}

}  // namespace dtrain::detail
