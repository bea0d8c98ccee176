// ZeRO stages 1-3 over dp_shard; with dp_replicate, HSDP (ZeRO inside each
// replica, its shards averaged across replicas).
#include "appliers.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/zero_strategy.h"

namespace dtrain::detail {

Parallelized apply_zero(const ApplyContext& c) {
  const c10::Device first = c.device();
  torch::nn::Sequential layers = c.parts.layers();
  LayerStack stack = c.stack(layers);
  stack->to(first);
  // ShardedDataParallel runs a Sequential unit by unit: the root itself, or
  // the one the stack holds under the model's name.
  std::shared_ptr<torch::nn::Module> root = stack.ptr();
  if (c.parts.name.empty()) root = layers.ptr();
  ZeroOptions zero{.stage = c.plan.zero_stage, .sequential = c.parts.name, .unit_policy = c.parts.zero_unit};
  dist::ProcessGroup shard_group = c.group();
  std::optional<dist::ProcessGroup> all;
  std::shared_ptr<dist::DeviceMesh> mesh;
  if (c.plan.dp_replicate > 1) {
    // Ranks row-major, so a rank's data-parallel index is its world rank.
    mesh = std::make_shared<dist::DeviceMesh>(c.group(), c.plan.mesh_dims());
    shard_group = (*mesh)["dp_shard"];
    zero.replicate_group = (*mesh)["dp_replicate"];
    all = c.group();
  }
  auto sdp = std::make_shared<ShardedDataParallel>(root, shard_group, zero);
  Parallelized r =
      trained_module_is_whole(std::make_shared<ZeroStrategy>(sdp, first, all), root, forward_on(stack, first));
  r.mesh = mesh;
  r.is_matrix = shards_of_matrices({sdp.get()});
  r.keep.push_back(sdp);
  return r;
}

}  // namespace dtrain::detail
