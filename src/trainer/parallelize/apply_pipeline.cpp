// The pipeline on pp: the model's layers (or its tp/cp split: split_model)
// cut into stages (the model's cut and ties, or the placement planner's),
// each stage's replicas averaged over the data-parallel dimensions by ZeRO
// (dp_shard, with cp ranks: dp_shard x cp; the plan's stage; HSDP with
// dp_replicate as well) or DDP (dp_replicate, x cp), or the options' stage
// sync. Stages split over tp or
// cp run on the mesh (PipelineOptions::mesh: norms from the layouts).
#include <algorithm>

#include "appliers.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/parallel/pipeline/schedule.h"
#include "dtrain/parallel/pipeline/stage_sync.h"
#include "dtrain/trainer/pipeline_strategy.h"
#include "released_parameters.h"

namespace dtrain::detail {

namespace {

std::vector<pipeline::PipelineStage> planned_stages(const torch::nn::Sequential& layers, const StageCut& cut) {
  const int n = cut.ranks * cut.stages_per_rank;
  const auto stage_of_layer = cut.stage_of_layer.empty() ? pipeline::plan_stages(layers, n) : cut.stage_of_layer;
  const std::vector<torch::nn::Sequential> all = pipeline::split_stages(layers, stage_of_layer);
  std::vector<pipeline::PipelineStage> mine;
  for (int s = cut.rank; s < n; s += cut.ranks) mine.push_back({.module = all[s]});
  return mine;
}

// What this rank's stages train or read: their modules' parameters and the
// tied ones they borrow.
std::vector<at::Tensor> stage_parameters(const std::vector<pipeline::PipelineStage>& stages) {
  std::vector<at::Tensor> out;
  for (const auto& stage : stages) {
    for (const auto& p : stage.module->parameters()) out.push_back(p);
    for (const auto& tied : stage.tied) out.push_back(tied.parameter);
  }
  return out;
}

// Brings every layer of `layers` on every rank up to date from the rank of
// the first replica that trains it (collective over `world`, the ranks that
// hold the same parts: all but tp; the layers of other stages are zeros
// here: their released parameters rematerialised). Sharded stages must hold
// their full parameters (PipelineStrategy::full_parameters).
void gather_layers(pipeline::Pipeline& pipe, const torch::nn::Sequential& layers, bool first_replica,
                   dist::ProcessGroup& world) {
  torch::NoGradGuard no_grad;
  std::vector<const torch::nn::Module*> mine;
  for (const auto& stage : pipe.stages())
    for (const auto& child : stage.module->children()) mine.push_back(child.get());
  for (const auto& layer : layers->children()) {
    const bool owner = first_replica && std::find(mine.begin(), mine.end(), layer.get()) != mine.end();
    for (auto& t : layer->parameters()) {
      at::Tensor v = owner ? t.detach().clone() : at::zeros_like(t);
      world.all_reduce(v).wait();
      t.copy_(v);
    }
  }
}

}  // namespace

Parallelized apply_pipeline(const ApplyContext& c) {
  const ParallelPlan& plan = c.plan;
  const c10::Device first = c.device();
  // The data-parallel ranks of a stage (cp ranks are replicas of its
  // parameters), and the ranks holding the same tp parts of every layer.
  const std::vector<std::string> data_dims{"dp_replicate", "dp_shard", "cp"};
  const std::vector<std::string> same_parts{"pp", "dp_replicate", "dp_shard", "cp"};
  dist::MeshOptions joins;
  if (plan.tp > 1) joins.joins.push_back(same_parts);
  auto mesh = std::make_shared<dist::DeviceMesh>(c.group(), plan.mesh_dims(), joins);
  // Every layer on every rank, initialised alike, so that one rank can run
  // the whole model after full_weights(); this rank trains its stages and
  // holds only their weights (the others' released until full_weights()).
  SplitModel m = split_model(c, *mesh);
  torch::nn::Sequential layers = m.trained;
  // The tp parts' layouts, read while every layer holds its parameters.
  dist::NamedLayouts tp_layouts;
  if (m.tensor_parallel) tp_layouts = dist::named_layouts(*layers, *mesh);
  const StageCut cut{.ranks = plan.pp,
                     .stages_per_rank = plan.pipeline.stages_per_rank,
                     .rank = mesh->coordinate("pp"),
                     .stage_of_layer = plan.pipeline.stage_of_layer};
  auto stages = c.parts.pipeline_stages ? c.parts.pipeline_stages(layers, cut) : planned_stages(layers, cut);
  const auto others = ReleasedParameters::release(*layers, identities(stage_parameters(stages)));
  layers->to(first);
  pipeline::PipelineOptions options{.schedule = pipeline::parse_schedule_kind(plan.pipeline.schedule),
                                    .micro_batches = plan.pipeline.micro_batches};
  // HSDP per stage (dp_replicate x dp_shard): ZeRO over dp_shard (x cp),
  // its shards averaged over dp_replicate (ZeroOptions::replicate_group), on
  // the mesh so that norms count a shard once over its replicas.
  const bool hsdp = plan.dp_replicate > 1 && plan.dp_shard > 1;
  const bool on_mesh = plan.tp > 1 || plan.cp > 1 || hsdp;
  if (on_mesh) options.mesh = *mesh;
  if (auto& data = mesh->join(data_dims); data.size() > 1) {
    ZeroOptions zero{.stage = plan.zero_stage};
    if (on_mesh) {
      zero.mesh = *mesh;
      zero.shard_dims = plan.cp > 1 ? std::vector<std::string>{"dp_shard", "cp"} : std::vector<std::string>{"dp_shard"};
    }
    options.data_parallel_group = data;
    options.stage_sync = c.options.stage_sync ? c.options.stage_sync
                         : plan.dp_shard > 1  ? pipeline::zero_stage_sync(zero)
                                              : pipeline::ddp_stage_sync();
    if (hsdp && !c.options.stage_sync) {
      // The stage's ZeRO shards over dp_shard (x cp), not the whole data group.
      zero.replicate_group = (*mesh)["dp_replicate"];
      options.stage_sync = [sync = pipeline::zero_stage_sync(zero), shards = mesh->join(zero.shard_dims)](
                               torch::nn::Sequential module, const std::optional<dist::ProcessGroup>& /*data*/) {
        return sync(std::move(module), shards);
      };
    }
  }
  auto pipe = std::make_shared<pipeline::Pipeline>(std::move(stages), (*mesh)["pp"], options, m.loss);
  auto strategy = std::make_shared<PipelineStrategy>(pipe, *mesh);
  if (m.targets) strategy->cut_targets(m.targets);
  // Checkpoints name the stages' parameters as the whole model does, so they
  // resume under every other plan and load every other plan's; tp stages
  // (the split has the whole model's names) write their parts with their
  // layouts.
  const std::string prefix = c.parts.name.empty() ? "" : c.parts.name + ".";
  if (m.tensor_parallel) {
    strategy->name_parameters(*layers, prefix, &tp_layouts);
  } else {
    strategy->name_parameters(*m.full, prefix);
  }
  LayerStack whole = c.stack(m.full);
  Parallelized r = trained_module_is_whole(strategy, whole.ptr(),
                                           forward_on(whole, m.tensor_parallel ? c10::Device(c10::kCPU) : first));
  r.mesh = mesh;
  r.pipeline = pipe;
  r.loss = m.loss;
  if (const auto sharded = pipe->sharded_stages(); !sharded.empty()) r.is_matrix = shards_of_matrices(sharded);
  const bool first_replica = mesh->join(data_dims).rank() == 0;
  dist::ProcessGroup same = m.tensor_parallel ? mesh->join(same_parts) : c.group();
  r.full_weights = [strategy, pipe, layers, others, unshared = m.unshared, first_replica, mesh, same, whole,
                    tp = m.tensor_parallel]() mutable {
    std::unique_ptr<Strategy::Scope> full = others->rematerialize(strategy->full_parameters());
    gather_layers(*pipe, layers, first_replica, same);
    if (tp) {
      full = unshared->rematerialize(std::move(full));
      assemble_by_layouts(*layers, *mesh, *whole->layers);
    }
    return full;
  };
  return r;
}

}  // namespace dtrain::detail
