// Context parallelism on cp (the model's split of every sequence), ZeRO over
// dp_shard x cp or DDP over dp_replicate x cp.
#include "appliers.h"
#include "dtrain/error.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/cp_strategy.h"
#include "dtrain/trainer/zero_strategy.h"

namespace dtrain::detail {

Parallelized apply_cp(const ApplyContext& c) {
  const c10::Device first = c.device();
  auto mesh = std::make_shared<dist::DeviceMesh>(c.group(), c.plan.mesh_dims());
  // The cp view shares the full layers' modules: they hold the full weights.
  SplitModel m = split_model(c, *mesh);
  LayerStack split = c.stack(m.trained);
  std::shared_ptr<Strategy> strategy;
  std::shared_ptr<ShardedDataParallel> sdp;
  if (c.plan.dp_shard > 1) {
    // Parameters are Replicate on cp: ZeRO shards over dp_shard x cp and so
    // averages their gradients over cp too (ZeroOptions::shard_dims).
    std::shared_ptr<torch::nn::Module> root = split.ptr();
    if (c.parts.name.empty()) root = m.trained.ptr();
    sdp = shard_with_zero(c, root, c.parts.name, mesh.get());
    strategy = std::make_shared<ZeroStrategy>(sdp, first);
    strategy->cut_targets(m.targets);
  } else {
    strategy = std::make_shared<ContextParallelStrategy<LayerStack>>(split, mesh, first, m.targets, c.options.ddp);
  }
  LayerStack whole = c.stack(m.full);
  Parallelized r = trained_module_is_whole(strategy, whole.ptr(), forward_on(whole, first));
  r.mesh = mesh;
  r.loss = m.loss;
  if (sdp) {
    r.is_matrix = shards_of_matrices({sdp.get()});
    r.keep.push_back(sdp);
  }
  return r;
}

}  // namespace dtrain::detail
