// --strategy pipeline of examples/gpt: the GPT's layers cut into stages over
// the ranks (pipeline_stages.h), trained by a schedule (gpipe, 1f1b,
// interleaved with 2 stages per rank, zb), on a data x pipeline mesh when the
// world holds several pipelines (--pp-size; each replica trains its share of
// the step's batch and averages gradients per stage over its data group, by
// --dp-reduce: ddp (DDP per stage, bucketed and overlapped with the stage's
// last backward), zero1 / zero2 (ShardedDataParallel per stage: optimizer
// state, and gradients, sharded over the data group) or allreduce (one
// all-reduce after the schedule)). The Trainer runs it through
// dtrain::PipelineStrategy like every other strategy of the example.
//
// The step's global batch is batch x replicas sequences (as DDP's is batch x
// world), so `--strategy pipeline` on any mesh ends where `single` does with
// the same global batch. --save-params writes each stage's parameters of
// replica 0 to FILE.stage<s> (their concatenation in stage order is single's
// file). Checkpoints: the Trainer's, laid out under Gpt's parameter names
// (resume under any plan; docs/checkpoints.md), committed atomically once
// every rank has written.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/pipeline_strategy.h"
#include "hf_export.h"
#include "model.h"
#include "pipeline_cli.h"
#include "pipeline_stages.h"
#include "zero_strategy.h"

namespace gpt {

// The GPT as a pipeline on this rank: every layer built and initialised on
// every rank (so one rank can run the whole network after gather_layers),
// this rank's stages trained.
struct GptPipeline {
  std::unique_ptr<dtrain::dist::DeviceMesh> mesh;
  torch::nn::Sequential layers;
  std::shared_ptr<dtrain::pipeline::Pipeline> pipe;
  std::shared_ptr<dtrain::PipelineStrategy> strategy;
  // Which parameters decay (sharded stages decide on their full parameters;
  // null: the 2-D ones).
  std::function<bool(const at::Tensor&)> decays;
  bool replica0 = false;  // this rank's stages are replica 0's
};

// `init_from_hf`: a Hugging Face GPT-2 folder (hf_export.h) every rank loads
// into the whole network before it is cut, so each stage starts from its
// layers' weights, as every other strategy does.
inline GptPipeline build_pipeline(const GptConfig& model, std::uint64_t seed, const examples::PipelineCli& cli,
                                  dtrain::dist::ProcessGroup world, const std::filesystem::path& init_from_hf = {}) {
  GptPipeline p;
  p.mesh = std::make_unique<dtrain::dist::DeviceMesh>(world, cli.mesh_dims(world.size()));
  p.layers = gpt_layers(model);
  init_weights(*p.layers, model.n_layer, seed);
  if (!init_from_hf.empty()) load_hf(*p.layers, model, init_from_hf);
  p.replica0 = p.mesh->join({"dp_replicate", "dp_shard"}).rank() == 0;
  p.pipe = std::make_shared<dtrain::pipeline::Pipeline>(
      pipeline_stages(p.layers, p.mesh->size("pp"), cli.stages_per_rank(), p.mesh->coordinate("pp")), (*p.mesh)["pp"],
      cli.options(*p.mesh), lm_loss);
  p.strategy = std::make_shared<dtrain::PipelineStrategy>(p.pipe, *p.mesh);
  // Checkpoints name the stages' parameters as Gpt does ("layers.<i>. ..."),
  // so they resume under every other plan and load every other plan's.
  p.strategy->name_parameters(*p.layers, "layers.");
  const std::vector<dtrain::ShardedDataParallel*> sharded = p.pipe->sharded_stages();
  if (!sharded.empty()) {
    std::vector<std::function<bool(const at::Tensor&)>> each;
    for (const auto* sdp : sharded) each.push_back(zero_decays(*sdp));
    p.decays = [each](const at::Tensor& t) {
      return std::any_of(each.begin(), each.end(), [&](const auto& d) { return d(t); });
    };
  }
  return p;
}

// Brings every layer of `layers` on every rank up to date from the rank of
// replica 0 that trains it (collective over the world; the layers of other
// stages were only initialised here), so one rank can run the whole network.
// Sharded stages must hold their full parameters (PipelineStrategy::full_parameters).
inline void gather_layers(const GptPipeline& p, dtrain::dist::ProcessGroup& world) {
  torch::NoGradGuard no_grad;
  std::vector<const torch::nn::Module*> mine;
  for (const auto& stage : p.pipe->stages())
    for (const auto& child : stage.module->children()) mine.push_back(child.get());
  for (const auto& layer : p.layers->children()) {
    const bool owner = p.replica0 && std::find(mine.begin(), mine.end(), layer.get()) != mine.end();
    for (auto& t : layer->parameters()) {
      at::Tensor v = owner ? t.detach().clone() : at::zeros_like(t);
      world.all_reduce(v).wait();
      t.copy_(v);
    }
  }
}

// Replica 0's stages each write FILE.stage<s> (raw float32, in order).
inline void write_stage_params(const GptPipeline& p, const std::string& file) {
  if (!p.replica0) return;
  const auto stages = p.pipe->schedule().stages_of_rank(p.pipe->group().rank());
  for (std::size_t k = 0; k < stages.size(); ++k) {
    std::ofstream out(file + ".stage" + std::to_string(stages[k]), std::ios::binary);
    for (const auto& t : p.pipe->stages()[k].module->parameters()) {
      const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
      out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
    }
  }
}

}  // namespace gpt
