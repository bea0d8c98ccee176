// parallelize: a ParallelPlan applied to a model, giving the Trainer's
// Strategy for this rank and what a program needs around the Trainer.
//
//   dtrain::ModelParts parts{.layers = [&] { return my_layers(seed); }, .name = "layers"};
//   dtrain::ParallelPlan plan{.dp_shard = 4, .zero_stage = 3};
//   plan.validate({.world = world.size()});
//   dtrain::Parallelized run = dtrain::parallelize(parts, plan, world, {.devices = {device}});
//   torch::optim::AdamW opt(run.strategy->parameters(), 1e-3);
//   dtrain::Trainer trainer(run.strategy, opt, source, options);
//   trainer.set_loss(run.loss);
//   trainer.fit();
//   auto full = run.full_weights();   // collective: every rank calls it
//   if (rank == 0) export_model(*run.whole);
//
// One applier per axis (src/trainer/parallelize/), tried in a fixed order;
// the first that handles the plan builds its strategy: the pipeline (pp > 1;
// stages of the model, or of its tp/cp split; each stage's replicas averaged
// by ZeRO over dp_shard (x cp) or DDP over dp_replicate (x cp)), tensor
// parallelism (tp > 1, with cp inside it; ZeRO over dp_shard (x cp) or DDP
// over dp_replicate (x cp)), context parallelism (cp > 1; ZeRO over
// dp_shard x cp or DDP over dp_replicate x cp), ZeRO 1-3 (dp_shard > 1; HSDP
// with dp_replicate > 1), DDP (dp_replicate > 1; over a ModelParallel split
// of this process's devices: the hybrid), and one process (one device,
// DataParallel or ModelParallel over several). The tp and cp splits are
// applied in one place (split_model) before the others wrap them, so every
// composition ParallelPlan::validate accepts is built from the same parts. What only the model knows
// (where its pipeline cuts and ties, its tensor- and context-parallel split
// and their losses) comes in through ModelParts; an axis the model gives no
// part for is a ConfigError naming it. Adding an axis: a part in ModelParts,
// an applier file, one row in the appliers' table (docs/architecture.md).
//
// Contracts:
//  - `plan` is validated by the caller (ParallelPlan::validate) for the
//    world's size; its degrees multiply to it;
//  - every rank calls parallelize with the same parts and plan (it makes
//    groups and DDP/ZeRO broadcast parameters: collective over `world`);
//  - ModelParts::layers builds the same initial weights on every rank; the
//    module trained holds them under `name` ("layers" gives
//    "layers.<layer>...."), the same names under every plan, so checkpoints
//    resume across plans (trainer/resharding.h);
//  - the result must outlive the Trainer that uses its strategy (it holds the
//    mesh the strategy's groups come from).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "dtrain/plan/plan.h"
#include "dtrain/trainer/strategy.h"

namespace dtrain {

using ModelLossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

// Where a pipeline cuts: stage s on pipeline rank s % ranks.
struct StageCut {
  int ranks = 1;            // the pipeline's ranks (pp)
  int stages_per_rank = 1;  // 2: the interleaved schedule
  int rank = 0;             // this rank's pp coordinate
  // One stage index per layer (the plan's); empty: the placement planner's
  // (pipeline::plan_stages).
  std::vector<std::size_t> stage_of_layer;
};

// The model, and the parts of its parallel forms that only it knows.
struct ModelParts {
  // The whole model as layers (input -> output), built and initialised alike
  // on every rank (seed it), on the CPU. Required.
  std::function<torch::nn::Sequential()> layers;
  // The name the trained module holds the layers under ("layers": parameters
  // "layers.<layer>.<...>"); empty: the Sequential itself is the module.
  std::string name;
  // Re-establishes references between layers that are not submodules (a tied
  // weight a later layer reads) in a deep copy (DataParallel's replicas).
  std::function<void(torch::nn::Sequential& copy)> retie;
  // The loss of the model's outputs (training and evaluation); default
  // cross-entropy.
  ModelLossFn loss;

  // ZeRO: which layers are sharding units (ZeroOptions::unit_policy, names
  // qualified by `name`); null: every layer.
  std::function<bool(const std::string& name, const torch::nn::Module& layer)> zero_unit;
  // Pipelines: this rank's stages of `layers` (sharing its modules) with
  // their tied parameters; null: pipeline::split_stages of the cut, no ties.
  // Under tp or cp `layers` is the split (tp.split's or cp.split's result),
  // with the same layer names.
  std::function<std::vector<pipeline::PipelineStage>(const torch::nn::Sequential& layers, const StageCut& cut)>
      pipeline_stages;
  // Tensor parallelism (plan tp > 1): this rank's split of `full` over
  // mesh["tp"] (parameter names as in `full`, layouts declared:
  // dist::DeclaresLayouts), and the loss of its outputs (collective over tp;
  // the mean over the tokens it is given). With plan cp > 1 too, the split
  // also keeps this rank's part of every sequence over mesh["cp"] as
  // cp.split would (its attention over cp), cp.targets cuts the targets, and
  // the loss is tp's averaged over cp (nn::cp::mean_loss).
  struct TensorParallel {
    std::function<torch::nn::Sequential(const torch::nn::Sequential& full, dist::DeviceMesh& mesh)> split;
    std::function<ModelLossFn(dist::DeviceMesh& mesh)> loss;
  } tp;
  // Context parallelism (plan cp > 1): this rank's view of `full` over
  // mesh["cp"] (sharing full's modules), the rows of a target its outputs
  // hold, and the loss (averaged over cp, nn::cp::mean_loss).
  struct ContextParallel {
    std::function<torch::nn::Sequential(const torch::nn::Sequential& full, dist::DeviceMesh& mesh)> split;
    std::function<at::Tensor(const at::Tensor& target, dist::DeviceMesh& mesh)> targets;
    std::function<ModelLossFn(dist::DeviceMesh& mesh)> loss;
  } cp;
};

// How one process uses several devices of its own (ParallelizeOptions::devices).
enum class LocalSplit {
  kNone,           // the first device only
  kDataParallel,   // DataParallel: each batch split over the devices (a world of one)
  kModelParallel,  // ModelParallel: the layers placed over the devices (under DDP: the hybrid)
};

struct ParallelizeOptions {
  // This process's devices; empty: the CPU.
  std::vector<c10::Device> devices;
  LocalSplit local = LocalSplit::kNone;
  DDPOptions ddp;  // DDP wherever it averages gradients (not inside pipelines)
  // Pipelines: how a stage's replicas average gradients (pipeline/stage_sync.h);
  // null: ZeRO at the plan's stage over dp_shard, else DDP over dp_replicate.
  pipeline::StageSyncFactory stage_sync;
};

// A plan applied: the strategy, and what a program needs around the Trainer.
struct Parallelized {
  std::shared_ptr<Strategy> strategy;
  std::string applier;                           // which applier built it ("tp", "pipeline", "zero", "ddp", ...)
  std::shared_ptr<dist::DeviceMesh> mesh;        // null where the applier needs none
  ModelLossFn loss;                              // for Trainer::set_loss (the model's, or its tp/cp form)
  std::shared_ptr<pipeline::Pipeline> pipeline;  // pp > 1
  // Whether `p`, one of strategy->parameters(), has two or more dimensions in
  // its full form (ZeRO's shards are 1-D): the rule for weight decay
  // (matrices and embeddings, not gains and biases).
  std::function<bool(const at::Tensor& p)> is_matrix;
  // The whole model (its layers under ModelParts::name), and its forward on
  // this rank alone (inputs moved to its device; no communication), valid
  // on rank 0 while full_weights()'s scope lives. Outside it, under a
  // pipeline or tp, the parameters this rank does not train (other stages,
  // tp's full copy) hold no storage (empty, their shapes restored by
  // full_weights()): a rank's memory is its part's only.
  std::shared_ptr<torch::nn::Module> whole;
  std::function<at::Tensor(const at::Tensor& input)> forward_whole;
  // Collective over the run (every rank calls it): while the returned scope
  // lives, `whole` holds the current full weights on rank 0 (sharded ones
  // gathered, pipeline stages brought from the ranks that train them, tp
  // splits assembled through their layouts), e.g. to sample or export.
  std::function<std::unique_ptr<Strategy::Scope>()> full_weights;
  std::vector<std::shared_ptr<void>> keep;  // objects the strategy refers to
};

// `world`: every rank of the run; nullopt for one process (plan world 1).
Parallelized parallelize(const ModelParts& parts, const ParallelPlan& plan, std::optional<dist::ProcessGroup> world,
                         const ParallelizeOptions& options = {});

}  // namespace dtrain
