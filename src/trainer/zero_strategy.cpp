// The Trainer's ZeRO strategy (include/dtrain/trainer/zero_strategy.h).
#include "dtrain/trainer/zero_strategy.h"

#include <torch/serialize/archive.h>

#include <map>

#include "dtrain/checkpoint/layout_state.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "dtrain/parallel/zero/full_state.h"
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
  if (tensor_parallel()) {
    state_ = laid_out_pieces(optimizer);
  } else {
    state_ = zero_state(*sdp_, optimizer);
  }
  added_to_ = &checkpointer;
}

bool ZeroStrategy::tensor_parallel() const {
  return sdp_->options().mesh && sdp_->options().mesh->size("tp") > 1;
}

// Each parameter's tp placement over {copies, tp} (Replicate on copies:
// HSDP's replicas, ZeroOptions::replicate_group, hold the same pieces, the
// first writes them), from the module's declared layouts; ZeRO's own
// dimensions (dp_shard, cp) hold disjoint pieces, cut by the flat range
// instead.
std::map<std::string, LaidOutTensor> ZeroStrategy::tp_parts() const {
  const dist::DeviceMesh& mesh = *sdp_->options().mesh;
  const auto& replicas = sdp_->options().replicate_group;
  const int copy = replicas ? replicas->rank() : 0, copies = replicas ? replicas->size() : 1;
  std::map<std::string, LaidOutTensor> out;
  for (const auto& [name, layout] : dist::named_layouts(sdp_->module(), mesh)) {
    const dist::Placement on_tp = layout.sole_placement_on("tp", "a ZeRO parameter " + name);
    out.emplace(name, LaidOutTensor{.layout = {.mesh = {{"copies", copies}, {"tp", mesh.size("tp")}},
                                               .placements = {dist::Placement::replicate(), on_tp},
                                               .global_shape = layout.global_shape},
                                    .coordinates = {copy, mesh.coordinate("tp")}});
  }
  return out;
}

// Note [ZeRO pieces of tp parts]: ZeRO flattens each tp rank's part of a
// parameter and cuts the flat units into chunks, so a rank's piece is a
// contiguous range of its part's elements in row-major order. Written as
// that flat range of the part's box (LaidOutTensor::flat_range: the few
// boxes of the global tensor it is made of) under the whole model's name,
// with the pieces' optimizer state alike, it is an ordinary laid-out state:
// every other plan (one process, tp with DDP, ZeRO of any world, pipelines)
// reads it by boxes or through its whole state, and this plan reads theirs
// into its parts' whole state (zero_parts_reader), which each rank then cuts
// into its chunks. Frozen parameters are written as whole parts (gathered
// by the save's full_parameters()), buffers by the first rank.
std::shared_ptr<LayoutState> ZeroStrategy::laid_out_pieces(torch::optim::Optimizer& optimizer) {
  // Buffers are written by the first rank of the mesh (all_: its group).
  const int rank = all_->rank(), ranks = all_->size();
  return parameter_state(
      [this, rank, ranks] {
        const std::map<std::string, LaidOutTensor> parts = tp_parts();
        std::vector<LaidOutParameter> out;
        const auto params = sdp_->module().named_parameters();
        for (const ZeroParameterInfo& p : zero_parameters(*sdp_)) {
          if (p.trainable) continue;
          LaidOutTensor t = parts.at(p.name);
          t.local = params[p.name];
          out.push_back({.name = p.name, .tensor = std::move(t)});
        }
        for (const ParameterShard& piece : sdp_->parameter_shards()) {
          LaidOutTensor t = parts.at(piece.name);
          t.local = piece.shard;
          t.flat_range = LaidOutTensor::FlatRange{.begin = piece.offset, .size = piece.shard.numel()};
          out.push_back({.name = piece.name, .tensor = std::move(t)});
        }
        for (const auto& item : sdp_->module().named_buffers()) {
          const std::vector<std::int64_t> shape(item.value().sizes().begin(), item.value().sizes().end());
          out.push_back({.name = item.key(),
                         .tensor = {.local = item.value(),
                                    .layout = {.mesh = {{"ranks", ranks}},
                                               .placements = {dist::Placement::replicate()},
                                               .global_shape = shape},
                                    .coordinates = {rank}},
                         .buffer = true});
        }
        return out;
      },
      &optimizer, zero_module_names(*sdp_));
}

void ZeroStrategy::save(Checkpointer& checkpointer, const TrainingState& state, torch::optim::Optimizer& optimizer) {
  add_to(checkpointer, optimizer);
  if (!tensor_parallel()) {
    register_saved_state(checkpointer, kZeroState, state_);
    checkpointer.save(state);
    return;
  }
  // Frozen parameters are written whole (their tp parts): gathered for the save.
  bool frozen = false;
  for (const ZeroParameterInfo& p : zero_parameters(*sdp_)) frozen = frozen || !p.trainable;
  std::unique_ptr<Scope> full = frozen ? full_parameters() : nullptr;
  register_saved_state(checkpointer, kLaidOutState, state_);
  checkpointer.save(state);
}

// ZeRO chunks of any world (and HSDP), or any laid-out plan (single, DDP,
// pipelines) through the whole state. Over tp parts: either through the
// parts' whole state (Note [ZeRO pieces of tp parts]).
std::optional<TrainingState> ZeroStrategy::load(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer) {
  add_to(checkpointer, optimizer);
  if (tensor_parallel()) {
    std::map<std::string, LaidOutTensor> parts = tp_parts();
    std::shared_ptr<LayoutState> reader =
        zero_parts_reader(*sdp_, optimizer, [parts = std::move(parts)](const std::string& name, at::Tensor local) {
          LaidOutTensor t = parts.at(name);
          t.local = std::move(local);
          return t;
        });
    return load_any_plan(checkpointer, {.laid_out = reader, .zero = zero_reader(reader)}, name());
  }
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
