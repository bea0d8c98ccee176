// The Trainer's pipeline strategy (include/dtrain/trainer/pipeline_strategy.h).
#include "dtrain/trainer/pipeline_strategy.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <functional>
#include <map>

#include "dtrain/error.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "dtrain/parallel/zero/full_state.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/resharding.h"

namespace dtrain {

PipelineStrategy::PipelineStrategy(std::shared_ptr<pipeline::Pipeline> pipe, dist::DeviceMesh& mesh)
    : pipe_(std::move(pipe)), world_(mesh.group()), pipeline_group_(mesh["pp"]) {
  DTRAIN_CHECK(pipe_ != nullptr, ConfigError, "PipelineStrategy got no Pipeline.",
               "pass std::make_shared<dtrain::pipeline::Pipeline>(stages, mesh[\"pp\"], options, loss)");
  DTRAIN_CHECK(pipe_->group().size() == mesh.size("pp") && pipe_->group().rank() == mesh.coordinate("pp"), ConfigError,
               "the Pipeline's group (rank " << pipe_->group().rank() << " of " << pipe_->group().size()
                                             << ") is not the mesh's pipeline group (" << mesh.describe() << ")",
               "build the Pipeline on mesh[\"pp\"]");
  auto& data = mesh.join({"dp_replicate", "dp_shard"});
  data_rank_ = data.rank();
  data_world_ = data.size();
  // The copies of each stage's parameters: its data-parallel ranks and, as
  // they hold every parameter alike, its cp ranks.
  replica_ = data_rank_ * mesh.size("cp") + mesh.coordinate("cp");
  replicas_ = data_world_ * mesh.size("cp");
  tensor_parallel_ = mesh.size("tp") > 1;
  tp_rank_ = mesh.coordinate("tp");
  tp_size_ = mesh.size("tp");
  const pipeline::Schedule& schedule = pipe_->schedule();
  loss_rank_ = schedule.rank_of_stage(schedule.stage_count() - 1);
  // module(): this rank's stages (train/eval modes, per-rank checkpoints)
  // and the borrowed tied copies that are no stage's parameters.
  holder_ = std::make_shared<torch::nn::Module>("PipelineStages");
  const auto stages = schedule.stages_of_rank(pipe_->group().rank());
  for (std::size_t k = 0; k < stages.size(); ++k) {
    holder_->register_module("stage" + std::to_string(stages[k]), pipe_->stages()[k].module.ptr());
    const auto& ties = pipe_->stages()[k].tied;
    for (std::size_t j = 0; j < ties.size(); ++j) {
      if (!ties[j].owner)
        holder_->register_parameter("tied" + std::to_string(stages[k]) + "_" + std::to_string(j), ties[j].parameter);
    }
  }
}

PipelineStrategy::~PipelineStrategy() = default;

std::string PipelineStrategy::name() const {
  return "pipeline";
}

torch::nn::Module& PipelineStrategy::module() {
  return *holder_;
}

std::vector<at::Tensor> PipelineStrategy::parameters() {
  return pipe_->parameters();
}

// ZeRO stages: every local stage's full parameters, gathered while the scope
// lives (stages 1-2 keep them afterwards until the next optimizer step;
// stage 3 frees them when it ends).
std::unique_ptr<Strategy::Scope> PipelineStrategy::full_parameters() {
  struct Guard : Scope {
    std::vector<std::unique_ptr<ShardedDataParallel::FullParameters>> guards;
  };
  auto guard = std::make_unique<Guard>();
  for (ShardedDataParallel* sdp : pipe_->sharded_stages())
    guard->guards.push_back(std::make_unique<ShardedDataParallel::FullParameters>(*sdp));
  return guard;
}

c10::Device PipelineStrategy::input_device() const {
  return pipeline_group_.device();
}
c10::Device PipelineStrategy::output_device() const {
  return pipeline_group_.device();
}

at::Tensor PipelineStrategy::forward(const at::Tensor& /*input*/) {
  DTRAIN_CHECK(false, ConfigError,
               "PipelineStrategy has no separate training forward: the loss lives on the last stage",
               "train through forward_backward (the Trainer does)");
  return {};
}

// Pads the batch to a multiple of the micro-batches (repeating its last
// example) and drops the padding's outputs.
bool PipelineStrategy::collective_forward() const {
  return !pipe_->sharded_stages().empty();
}

at::Tensor PipelineStrategy::eval_forward(const at::Tensor& input) {
  const int m = pipe_->schedule().options.micro_batches;
  const std::int64_t n = input.size(0);
  const std::int64_t padded = (n + m - 1) / m * m;
  at::Tensor x = input;
  if (padded != n) x = at::cat({input, input.narrow(0, n - 1, 1).expand_as(input.narrow(0, 0, padded - n))}, 0);
  at::Tensor out = pipe_->forward(x);
  return out.defined() ? out.narrow(0, 0, n) : out;
}

at::Tensor PipelineStrategy::forward_backward(const at::Tensor& input, const at::Tensor& target,
                                              amp::GradScaler* scaler) {
  at::Tensor loss = pipe_->step(input, local_target(target), scaler);
  at::Tensor shared = loss.defined() ? loss.detach().to(at::kFloat).reshape({1}).clone()
                                     : at::zeros({1}, at::TensorOptions(at::kFloat).device(input_device()));
  if (pipeline_group_.size() > 1) pipeline_group_.broadcast(shared, loss_rank_).wait();
  return shared.reshape({});
}

void PipelineStrategy::zero_grad(torch::optim::Optimizer& /*optimizer*/) {
  pipe_->zero_grad();
}

GradientSet PipelineStrategy::gradients() {
  return pipe_->gradient_set();
}

at::Tensor PipelineStrategy::clip_grad_norm(double max_norm) {
  return pipe_->clip_grad_norm_(max_norm);
}

// tp parts unnamed would be saved as whole parameters.
void PipelineStrategy::check_checkpointable() const {
  DTRAIN_CHECK(!tensor_parallel_ || !tp_layouts_.empty(), ConfigError,
               "checkpoints of pipeline stages split over tp need their layouts (PipelineStrategy::name_parameters).",
               "name the stages' parameters with the tp split's layouts before saving or loading");
}

void PipelineStrategy::name_parameters(const torch::nn::Module& whole, const std::string& prefix,
                                       const dist::NamedLayouts* layouts) {
  global_names_.clear();
  whole_names_.clear();
  tp_layouts_.clear();
  std::map<std::string, const dist::Layout*> layout_of;
  if (layouts != nullptr)
    for (const auto& [name, layout] : *layouts) layout_of.emplace(name, &layout);
  for (const auto& item : whole.named_parameters()) {
    const std::string& name = item.key();
    const at::Tensor& p = item.value();
    global_names_.emplace(p.unsafeGetTensorImpl(), prefix + name);
    whole_names_.push_back(prefix + name);
    const auto it = layout_of.find(name);
    if (it == layout_of.end()) continue;
    // This rank's tp part, replicated over the stage's copies (the first
    // writes it); a layout sharded on another dimension is none of a
    // pipeline's tp stages'.
    const dist::Layout& full = *it->second;
    const dist::Placement on_tp = full.sole_placement_on("tp", "a pipeline stage's parameter " + name);
    tp_layouts_.emplace(p.unsafeGetTensorImpl(), dist::Layout{.mesh = {{"replicas", replicas_}, {"tp", tp_size_}},
                                                              .placements = {dist::Placement::replicate(), on_tp},
                                                              .global_shape = full.global_shape});
  }
  for (const auto& item : whole.named_buffers()) {
    const std::string& name = item.key();
    const at::Tensor& b = item.value();
    global_names_.emplace(b.unsafeGetTensorImpl(), prefix + name);
    whole_names_.push_back(prefix + name);
  }
  laid_out_.reset();
}

// A tensor's name in checkpoints: its whole-model name (name_parameters),
// else `local`.
std::string PipelineStrategy::global_name(const at::Tensor& t, const std::string& local) const {
  const auto it = global_names_.find(t.unsafeGetTensorImpl());
  return it != global_names_.end() ? it->second : local;
}

// The one place that reads the stages for checkpoints: each stage's own
// parameters and buffers, written by the first replica of the stage (data
// rank 0), and the borrowed tied copies, loaded (from their owner's name)
// but not written. A sharded (ZeRO) stage writes its trainable parameters as
// this rank's pieces of each one flattened (global shape [numel], the box of
// its chunk: every data rank writes its own; a load of another shape reads
// them whole, Note [Another shape of the same tensor]) with the optimizer
// state of the pieces, and its frozen ones whole (inside full_parameters()).
// Stages of tp parts write each piece as the flat range of this tp rank's
// part that it is (Note [ZeRO pieces of tp parts] in zero_strategy.cpp):
// the part's tp placement, Replicate on tp for the parameters tp does not
// split (the first tp rank writes those).
std::vector<LaidOutParameter> PipelineStrategy::laid_out_parameters() {
  std::vector<LaidOutParameter> out;
  const auto stages = pipe_->schedule().stages_of_rank(pipe_->group().rank());
  const std::vector<ShardedDataParallel*> sharded = pipe_->sharded_stages();
  DTRAIN_INTERNAL_ASSERT(sharded.empty() || sharded.size() == stages.size(),
                         "a pipeline rank has sharded and unsharded stages");
  auto add = [&](const std::string& local, const at::Tensor& t, bool buffer, bool saved) {
    const std::vector<std::int64_t> shape(t.sizes().begin(), t.sizes().end());
    if (const auto tp = tp_layouts_.find(t.unsafeGetTensorImpl()); tp != tp_layouts_.end()) {
      out.push_back({.name = global_name(t, local),
                     .tensor = {.local = t, .layout = tp->second, .coordinates = {replica_, tp_rank_}, .saved = saved},
                     .buffer = buffer});
      return;
    }
    out.push_back({.name = global_name(t, local),
                   .tensor = {.local = t,
                              .layout = {.mesh = {{"replicas", replicas_}},
                                         .placements = {dist::Placement::replicate()},
                                         .global_shape = shape},
                              .coordinates = {replica_},
                              .saved = saved || global_names_.find(t.unsafeGetTensorImpl()) == global_names_.end()},
                   .buffer = buffer});
  };
  for (std::size_t k = 0; k < stages.size(); ++k) {
    const std::string stage = "stage" + std::to_string(stages[k]) + ".";
    const auto& module = *pipe_->stages()[k].module;
    auto params = module.named_parameters();
    if (sharded.empty()) {
      for (const auto& item : params) add(stage + item.key(), item.value(), false, true);
    } else {
      std::map<std::string, std::int64_t> numel;
      for (const ZeroParameterInfo& p : zero_parameters(*sharded[k])) {
        numel[p.name] = c10::multiply_integers(p.shape);
        if (!p.trainable) add(stage + p.name, params[p.name], false, true);
      }
      // HSDP's replicas of the stage (ZeroOptions::replicate_group) hold the
      // same pieces: the first writes them.
      const auto& replicas = sharded[k]->options().replicate_group;
      const int copy = replicas ? replicas->rank() : 0, copies = replicas ? replicas->size() : 1;
      for (const ParameterShard& piece : sharded[k]->parameter_shards()) {
        if (tensor_parallel_) {
          out.push_back({.name = global_name(params[piece.name], stage + piece.name),
                         .tensor = tp_part(params[piece.name], piece.shard, copy, copies)});
          out.back().tensor.flat_range = LaidOutTensor::FlatRange{.begin = piece.offset, .size = piece.shard.numel()};
          continue;
        }
        out.push_back({.name = global_name(params[piece.name], stage + piece.name),
                       .tensor = {.local = piece.shard,
                                  .layout = {.mesh = {{"copies", copies}},
                                             .placements = {dist::Placement::replicate()},
                                             .global_shape = {numel.at(piece.name)}},
                                  .coordinates = {copy},
                                  .box = dist::Box{.offsets = {piece.offset}, .sizes = {piece.shard.numel()}}}});
      }
    }
    for (const auto& item : module.named_buffers()) add(stage + item.key(), item.value(), true, true);
    const auto& ties = pipe_->stages()[k].tied;
    for (std::size_t j = 0; j < ties.size(); ++j)
      if (!ties[j].owner) add(stage + "tied" + std::to_string(j), ties[j].parameter, false, false);
  }
  return out;
}

// This tp rank's part of `parameter` over {tp} (its placement there, or
// Replicate for a parameter tp does not split), holding `local`.
LaidOutTensor PipelineStrategy::tp_part(const at::Tensor& parameter, at::Tensor local, int copy, int copies) const {
  // Over {copies, tp}: the `copies` ranks holding the same piece (HSDP's
  // replicas) write it once, from the first.
  LaidOutTensor t{.local = std::move(local), .coordinates = {copy, tp_rank_}};
  const std::vector<dist::MeshDim> dims{{"copies", copies}, {"tp", tp_size_}};
  if (const auto it = tp_layouts_.find(parameter.unsafeGetTensorImpl()); it != tp_layouts_.end()) {
    t.layout = {.mesh = dims,
                .placements = {dist::Placement::replicate(), it->second.placements[1]},
                .global_shape = it->second.global_shape};
  } else {
    t.layout = {.mesh = dims,
                .placements = {dist::Placement::replicate(), dist::Placement::replicate()},
                .global_shape = std::vector<std::int64_t>(parameter.sizes().begin(), parameter.sizes().end())};
  }
  return t;
}

std::shared_ptr<LayoutState> PipelineStrategy::laid_out_state(torch::optim::Optimizer& optimizer) {
  if (!laid_out_) laid_out_ = parameter_state([this] { return laid_out_parameters(); }, &optimizer, whole_names_);
  return laid_out_;
}

// Sharded stages load through their whole state: each stage's parameters
// and optimizer state whole (zero_whole_targets, by their global names), its
// buffers and borrowed tied copies in place; then each stage takes its
// chunks (load_zero_full_state).
std::shared_ptr<LayoutState> PipelineStrategy::sharded_reader(torch::optim::Optimizer& optimizer) {
  struct Reader {
    std::vector<ZeroWholeTargets> stages;
    LayoutState* state = nullptr;
  };
  auto reader = std::make_shared<Reader>();
  auto collect = [this, reader, &optimizer] {
    reader->stages.clear();
    LaidOutTensors all;
    const auto stages = pipe_->schedule().stages_of_rank(pipe_->group().rank());
    const std::vector<ShardedDataParallel*> sharded = pipe_->sharded_stages();
    for (std::size_t k = 0; k < stages.size(); ++k) {
      const std::string stage = "stage" + std::to_string(stages[k]) + ".";
      auto params = pipe_->stages()[k].module->named_parameters();
      // Stages of tp parts: each target is this tp rank's part.
      PartOf part_of;
      if (tensor_parallel_)
        part_of = [&](const std::string& name, at::Tensor local) { return tp_part(params[name], std::move(local)); };
      reader->stages.push_back(zero_whole_targets(
          *sharded[k], optimizer, [&](const std::string& name) { return global_name(params[name], stage + name); },
          part_of));
      const LaidOutTensors& mine = reader->stages.back().tensors;
      all.insert(all.end(), mine.begin(), mine.end());
      for (const auto& item : pipe_->stages()[k].module->named_buffers())
        all.emplace_back("model." + global_name(item.value(), stage + item.key()), whole_tensor(item.value(), true));
      const auto& ties = pipe_->stages()[k].tied;
      for (std::size_t j = 0; j < ties.size(); ++j) {
        if (!ties[j].owner)
          all.emplace_back(
              "model." + global_name(ties[j].parameter, stage + "tied" + std::to_string(j)),
              tensor_parallel_ ? tp_part(ties[j].parameter, ties[j].parameter) : whole_tensor(ties[j].parameter));
      }
    }
    return all;
  };
  auto after_load = [reader] {
    for (ZeroWholeTargets& stage : reader->stages)
      stage.finish([&](const std::string& name) { return reader->state->loaded(name); });
  };
  auto state = std::make_shared<LayoutState>(collect, after_load);
  reader->state = state.get();
  // Without name_parameters the names are the stages' ("stage<s>."): any may be saved.
  if (!whole_names_.empty()) state->set_known(known_model_names(whole_names_));
  return state;
}

void PipelineStrategy::save(Checkpointer& checkpointer, const TrainingState& state,
                            torch::optim::Optimizer& optimizer) {
  check_checkpointable();
  auto full = full_parameters();  // frozen parameters of sharded stages are written whole
  register_saved_state(checkpointer, kLaidOutState, laid_out_state(optimizer));
  checkpointer.save(state);
}

std::optional<TrainingState> PipelineStrategy::load(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer) {
  check_checkpointable();
  const bool sharded = !pipe_->sharded_stages().empty();
  if (sharded && saved_model_state(checkpointer) == SavedModelState::kOther) {
    // Sharded stages' checkpoints before they were laid out: each rank's
    // stages and optimizer state, per rank (the same mesh only).
    checkpointer.remove_state(kLaidOutState);
    checkpointer.add_state("pipeline_stages", module_state(*holder_), StateScope::kPerRank);
    checkpointer.add_state("pipeline_optimizer", optimizer_state(optimizer), StateScope::kPerRank);
    struct Remove {
      Checkpointer& c;
      ~Remove() {
        c.remove_state("pipeline_stages");
        c.remove_state("pipeline_optimizer");
      }
    } remove{checkpointer};
    return checkpointer.load_latest();
  }
  const std::shared_ptr<LayoutState> mine = sharded ? sharded_reader(optimizer) : laid_out_state(optimizer);
  return load_any_plan(checkpointer, {.laid_out = mine, .zero = zero_reader(mine)}, name());
}

}  // namespace dtrain
