// The Trainer's strategy for sharded data parallelism (ZeRO stages 1-3):
//
//   auto sdp = std::make_shared<dtrain::ShardedDataParallel>(model, group, dtrain::ZeroOptions{.stage = 2});
//   auto strategy = std::make_shared<dtrain::ZeroStrategy>(sdp, c10::kCPU);
//   torch::optim::AdamW opt(strategy->parameters(), 1e-3);    // the same shards
//   dtrain::Trainer trainer(strategy, opt, data, options);
//
// Forward and evaluation go through ShardedDataParallel (stage 3 gathers each
// unit as it runs); accumulation's first micro-batches run under its no_sync
// (full gradients kept until the last, memory as DDP); clipping sums the
// shards' squares over the group (GradientSet::sharded); GradScaler's found-inf
// is combined over the group (under HSDP the replicas' gradients are equal
// after their all-reduce, so the shard group suffices). Checkpoints hold this rank's shards of the
// parameters and optimizer state as StateScope::kSharded state of the
// Trainer's Checkpointer (zero_state), committed with the sampler, schedule,
// scaler and generators: a run saved on N ranks resumes on any number, and
// loads the laid-out checkpoints of the other plans (trainer/resharding.h).
#pragma once

#include <map>
#include <memory>
#include <string>

#include "dtrain/checkpoint/layout_state.h"

#include "dtrain/trainer/strategy.h"

namespace dtrain {

class ShardedDataParallel;

class ZeroStrategy : public Strategy {
 public:
  // The optimizer given to the Trainer must be over sdp->parameters().
  // HSDP (ZeroOptions::replicate_group set): `world` is every rank of the run
  // (evaluation and metrics reduce over it; the data index is the replica's
  // index x shard size + the shard rank). With ZeroOptions::mesh (tp parts,
  // or cp ranks in the sharding group) the mesh says all that: the data
  // index is its dp_replicate x dp_shard one, norms come from the layouts,
  // found-inf and metrics reduce over the whole mesh, and `world` is unused;
  // under tp, checkpoints are laid out: each rank's pieces of its tp parts
  // with their tp placement and flat range under the module's names (Note
  // [ZeRO pieces of tp parts]), so they reshard to and from every plan.
  ZeroStrategy(std::shared_ptr<ShardedDataParallel> sdp, c10::Device device,
               std::optional<dist::ProcessGroup> world = std::nullopt);
  ~ZeroStrategy() override;

  std::string name() const override;
  torch::nn::Module& module() override;
  std::vector<at::Tensor> parameters() override;
  std::unique_ptr<Scope> full_parameters() override;
  c10::Device input_device() const override { return device_; }
  c10::Device output_device() const override { return device_; }
  at::Tensor forward(const at::Tensor& input) override;
  bool collective_forward() const override;
  std::unique_ptr<Scope> no_sync() override;
  void zero_grad(torch::optim::Optimizer& optimizer) override;
  GradientSet gradients() override;
  std::optional<dist::ProcessGroup> found_inf_group() override;
  int data_rank() const override { return rank_; }
  int data_world() const override { return world_; }
  std::optional<dist::ProcessGroup> group() override;
  void save(Checkpointer& checkpointer, const TrainingState& state, torch::optim::Optimizer& optimizer) override;
  std::optional<TrainingState> load(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer) override;
  // This rank's chunks and their optimizer state (as its checkpoint part),
  // and the module's buffers: a recovering rank loads its counterpart's
  // part, of the same sharding. ConfigError under HSDP (the fault-tolerant
  // replica groups are the dp_replicate dimension themselves).
  ft::ReplicaState replica_state(torch::optim::Optimizer& optimizer, ft::ReplicaState extra) override;

  ShardedDataParallel& sdp() { return *sdp_; }

 private:
  void add_to(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer);
  bool tensor_parallel() const;  // over a mesh with tp > 1: laid-out checkpoints
  std::map<std::string, LaidOutTensor> tp_parts() const;
  std::shared_ptr<LayoutState> laid_out_pieces(torch::optim::Optimizer& optimizer);
  std::shared_ptr<ShardedDataParallel> sdp_;
  c10::Device device_;
  int rank_ = 0;
  int world_ = 1;
  std::optional<dist::ProcessGroup> all_;   // HSDP or a mesh: every rank
  bool over_mesh_ = false;                  // ZeroOptions::mesh: norms from the layouts
  const Checkpointer* added_to_ = nullptr;  // the checkpointer holding our state
  std::shared_ptr<ShardedStateful> state_;  // zero_state(), saved as "zero"; under tp laid_out_pieces()
};

}  // namespace dtrain
