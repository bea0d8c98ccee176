// The Trainer's ZeRO strategy (include/dtrain/trainer/zero_strategy.h).
#include "dtrain/trainer/zero_strategy.h"

#include <torch/serialize/archive.h>

#include "dtrain/error.h"
#include "dtrain/parallel/zero/sharded_checkpoint.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/resharding.h"

namespace dtrain {

ZeroStrategy::ZeroStrategy(std::shared_ptr<ShardedDataParallel> sdp, c10::Device device,
                           std::optional<dist::ProcessGroup> world)
    : sdp_(std::move(sdp)), device_(device), all_(std::move(world)) {
  DTRAIN_CHECK(sdp_ != nullptr, ConfigError, "ZeroStrategy got no ShardedDataParallel.",
               "pass std::make_shared<dtrain::ShardedDataParallel>(model, group, options)");
  rank_ = sdp_->group().rank();
  world_ = sdp_->group().size();
  const auto& replicas = sdp_->options().replicate_group;
  if (sdp_->options().mesh) {
    // Parameters laid out over a mesh (tp parts; cp ranks in the sharding
    // group): the data index is the mesh's, every rank of the mesh reduces.
    dist::DeviceMesh mesh = *sdp_->options().mesh;
    rank_ = mesh.coordinate("dp_replicate") * mesh.size("dp_shard") + mesh.coordinate("dp_shard");
    world_ = mesh.size("dp_replicate") * mesh.size("dp_shard");
    all_ = mesh.group();
    over_mesh_ = true;
  } else if (replicas && replicas->size() > 1) {
    DTRAIN_CHECK(all_ && all_->size() == replicas->size() * world_, ConfigError,
                 "ZeroStrategy over HSDP (" << replicas->size() << " replicas of " << world_
                                            << " shards) needs the group of all " << replicas->size() * world_
                                            << " ranks.",
                 "pass the world group as ZeroStrategy's third argument");
    rank_ += replicas->rank() * world_;
    world_ *= replicas->size();
  } else {
    all_.reset();
  }
}

ZeroStrategy::~ZeroStrategy() = default;

std::string ZeroStrategy::name() const {
  return "zero" + std::to_string(sdp_->options().stage);
}

torch::nn::Module& ZeroStrategy::module() {
  return sdp_->module();
}

std::vector<at::Tensor> ZeroStrategy::parameters() {
  return sdp_->parameters();
}

std::unique_ptr<Strategy::Scope> ZeroStrategy::full_parameters() {
  struct Guard : Scope {
    explicit Guard(ShardedDataParallel& sdp) : guard(sdp.full_parameters()) {}
    ShardedDataParallel::FullParameters guard;
  };
  return std::make_unique<Guard>(*sdp_);
}

at::Tensor ZeroStrategy::forward(const at::Tensor& input) {
  return sdp_->forward(input);
}

std::unique_ptr<Strategy::Scope> ZeroStrategy::no_sync() {
  struct Guard : Scope {
    explicit Guard(ShardedDataParallel& sdp) : guard(sdp.no_sync()) {}
    ShardedDataParallel::NoSync guard;
  };
  return std::make_unique<Guard>(*sdp_);
}

// The shards' gradients and any full gradients kept (stage 1, no_sync); the
// optimizer's own zero_grad would not reach the latter.
void ZeroStrategy::zero_grad(torch::optim::Optimizer& /*optimizer*/) {
  sdp_->zero_grad();
}

// Over a mesh: from the layouts (ShardedDataParallel::gradients, the norm
// combined over the sharding group and tp).
GradientSet ZeroStrategy::gradients() {
  if (over_mesh_) return sdp_->gradients();
  return GradientSet::sharded(sdp_->parameters(), sdp_->group());
}

// Over a mesh, tp ranks hold different gradients: every rank decides alike.
std::optional<dist::ProcessGroup> ZeroStrategy::found_inf_group() {
  return over_mesh_ ? all_ : std::optional<dist::ProcessGroup>(sdp_->group());
}

std::optional<dist::ProcessGroup> ZeroStrategy::group() {
  return all_ ? all_ : std::optional<dist::ProcessGroup>(sdp_->group());
}

// Stage 3 gathers units in forward; stages 1-2 all-gather the updated
// parameters in the first forward after a step (pre_forward).
bool ZeroStrategy::collective_forward() const {
  return true;
}

void ZeroStrategy::add_to(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer) {
  if (added_to_ == &checkpointer) return;
  DTRAIN_CHECK(added_to_ == nullptr, ConfigError, "ZeroStrategy is used with a second Checkpointer.",
               "use one Trainer (one checkpoint directory) per strategy");
  // Chunks of tp parts would be saved as chunks of whole parameters.
  DTRAIN_CHECK(!sdp_->options().mesh || sdp_->options().mesh->size("tp") == 1, ConfigError,
               "checkpoints of ZeRO over tensor-parallel layers (mesh " << sdp_->options().mesh->describe()
                                                                        << ") are not supported yet.",
               "train without a checkpoint directory, or put the data-parallel ranks on dp_replicate beside tp");
  state_ = zero_state(*sdp_, optimizer);
  added_to_ = &checkpointer;
}

void ZeroStrategy::save(Checkpointer& checkpointer, const TrainingState& state, torch::optim::Optimizer& optimizer) {
  add_to(checkpointer, optimizer);
  register_saved_state(checkpointer, kZeroState, state_);
  checkpointer.save(state);
}

// ZeRO chunks of any world (and HSDP), or any laid-out plan (single, DDP,
// pipelines) through the whole state.
std::optional<TrainingState> ZeroStrategy::load(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer) {
  add_to(checkpointer, optimizer);
  return load_any_plan(checkpointer, {.laid_out = laid_out_reader(*sdp_, optimizer), .zero = state_}, name());
}

// The part is written as a checkpoint's (zero_state): the receiver's
// counterpart has the same rank in a group of the same size, so its part
// covers exactly this rank's chunk (load_counterpart_part).
ft::ReplicaState ZeroStrategy::replica_state(torch::optim::Optimizer& optimizer, ft::ReplicaState extra) {
  DTRAIN_CHECK(!all_, ConfigError,
               "ZeroStrategy over HSDP (ZeroOptions::replicate_group) inside a fault-tolerant replica group is not "
               "supported.",
               "shard over the replica group's ranks only: the fault-tolerant replica groups are the dp_replicate "
               "dimension");
  std::shared_ptr<ShardedStateful> shards = zero_state(*sdp_, optimizer);
  torch::nn::Module* module = &sdp_->module();
  ShardedDataParallel* sdp = sdp_.get();
  torch::optim::Optimizer* opt = &optimizer;
  return {.save =
              [shards, module, extra](torch::serialize::OutputArchive& archive) {
                torch::serialize::OutputArchive part;
                shards->save_state(part);
                archive.write("zero", part);
                for (const auto& b : module->named_buffers()) archive.write("buffer/" + b.key(), b.value());
                if (extra.save) extra.save(archive);
              },
          .load =
              [sdp, opt, module, extra](torch::serialize::InputArchive& archive) {
                torch::serialize::InputArchive part;
                archive.read("zero", part);
                load_counterpart_part(*sdp, *opt, part);
                torch::NoGradGuard no_grad;
                for (auto& b : module->named_buffers()) {
                  at::Tensor read;
                  archive.read("buffer/" + b.key(), read);
                  b.value().copy_(read);
                }
                if (extra.load) extra.load(archive);
              }};
}

}  // namespace dtrain
