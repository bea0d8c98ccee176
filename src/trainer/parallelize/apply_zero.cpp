// ZeRO stages 1-3 over dp_shard; with dp_replicate, HSDP (ZeRO inside each
// replica, its shards averaged across replicas). shard_with_zero is also
// what the tp and cp appliers shard their splits with.
#include "appliers.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/zero_strategy.h"

namespace dtrain::detail {

std::shared_ptr<ShardedDataParallel> shard_with_zero(const ApplyContext& c, std::shared_ptr<torch::nn::Module> root,
                                                     const std::string& sequential, dist::DeviceMesh* mesh) {
  ZeroOptions zero{.stage = c.plan.zero_stage, .sequential = sequential, .unit_policy = c.parts.zero_unit};
  dist::ProcessGroup shard_group = c.group();
  if (mesh != nullptr) {
    // Ranks row-major, so a rank's data-parallel index is its index in
    // mesh.join({"dp_replicate", "dp_shard"}).
    if (mesh->size("tp") > 1 || mesh->size("cp") > 1) {
      zero.mesh = *mesh;
      zero.shard_dims =
          mesh->size("cp") > 1 ? std::vector<std::string>{"dp_shard", "cp"} : std::vector<std::string>{"dp_shard"};
    }
    shard_group = mesh->join(zero.shard_dims);
    if (mesh->size("dp_replicate") > 1) zero.replicate_group = (*mesh)["dp_replicate"];
  }
  return std::make_shared<ShardedDataParallel>(std::move(root), shard_group, zero);
}

Parallelized apply_zero(const ApplyContext& c) {
  const c10::Device first = c.device();
  torch::nn::Sequential layers = c.parts.layers();
  LayerStack stack = c.stack(layers);
  stack->to(first);
  // ShardedDataParallel runs a Sequential unit by unit: the root itself, or
  // the one the stack holds under the model's name.
  std::shared_ptr<torch::nn::Module> root = stack.ptr();
  if (c.parts.name.empty()) root = layers.ptr();
  std::shared_ptr<dist::DeviceMesh> mesh;
  if (c.plan.dp_replicate > 1) mesh = std::make_shared<dist::DeviceMesh>(c.group(), c.plan.mesh_dims());
  auto sdp = shard_with_zero(c, root, c.parts.name, mesh.get());
  std::optional<dist::ProcessGroup> all;
  if (mesh) all = c.group();
  Parallelized r =
      trained_module_is_whole(std::make_shared<ZeroStrategy>(sdp, first, all), root, forward_on(stack, first));
  r.mesh = mesh;
  r.is_matrix = shards_of_matrices({sdp.get()});
  r.keep.push_back(sdp);
  return r;
}

}  // namespace dtrain::detail
