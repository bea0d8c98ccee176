// --strategy pipeline of examples/gpt: the GPT's layers cut into stages over
// the ranks (pipeline_stages.h), trained by a schedule (gpipe, 1f1b,
// interleaved with 2 stages per rank, zb), on a data x pipeline mesh when the
// world holds several pipelines (--pp-size; each replica trains its share of
// the step's batch and averages gradients per stage over its data group, by
// --dp-reduce: ddp (DDP per stage, bucketed and overlapped with the stage's
// last backward), zero1 / zero2 (ShardedDataParallel per stage: optimizer
// state, and gradients, sharded over the data group) or allreduce (one
// all-reduce after the schedule)).
//
// The step's global batch is batch x replicas sequences (as DDP's is batch x
// world), so `--strategy pipeline` on any mesh ends where `single` does with
// the same global batch. The loss lives on the last stage; eval losses are
// combined over the world so that rank 0 prints them; --save-params writes
// each stage's parameters of replica 0 to FILE.stage<s> (their concatenation
// in stage order is single's file). Checkpoints: one per save for the whole
// world, each rank's stages and optimizer its own part (per-rank parts of
// dtrain::Checkpointer), committed atomically once every rank has written.
//
// For tests of restarts: DTRAIN_GPT_KILL_LAST_STAGE_AT=N makes the last
// stage's process SIGKILL itself at step N of the launcher's first attempt.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "corpus.h"
#include "dtrain/comm/env.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "dtrain/trainer/checkpoint.h"
#include "dtrain/trainer/progress.h"
#include "model.h"
#include "pipeline_cli.h"
#include "pipeline_stages.h"
#include "sample.h"
#include "zero_strategy.h"

namespace gpt {

struct PipelineRun {
  GptConfig model;
  examples::PipelineCli pipeline;  // schedule, micro-batches, mesh, --dp-reduce
  std::int64_t batch_size = 12, max_iters = 0, eval_interval = 250, eval_iters = 20;
  std::uint64_t seed = 1337;
  double grad_clip = 1.0;
  std::string save_params, checkpoint_dir;
  SampleOptions sample;  // tokens 0: no sample
  std::function<double(std::int64_t)> learning_rate;
  // The parameters, and which of them decay (null: the 2-D ones).
  std::function<std::unique_ptr<torch::optim::AdamW>(const std::vector<at::Tensor>&,
                                                     const std::function<bool(const at::Tensor&)>&)>
      make_optimizer;
};

// A module holding a rank's stages (and a tied copy), for checkpoints.
struct StagesHolderImpl : torch::nn::Module {
  explicit StagesHolderImpl(const dtrain::pipeline::Pipeline& pipe) {
    const auto stages = pipe.schedule().stages_of_rank(pipe.group().rank());
    for (std::size_t k = 0; k < stages.size(); ++k) {
      register_module("stage" + std::to_string(stages[k]), pipe.stages()[k].module);
      for (const auto& tied : pipe.stages()[k].tied) {
        if (!tied.owner) register_parameter("tied" + std::to_string(stages[k]), tied.parameter);
      }
    }
  }
};
TORCH_MODULE(StagesHolder);

// Brings every layer of `layers` on every rank up to date from the rank of
// replica 0 that trains it (collective over the world; the layers of other
// stages were only initialised here), so one rank can run the whole network.
inline void gather_layers(const torch::nn::Sequential& layers, const dtrain::pipeline::Pipeline& pipe, bool replica0,
                          dtrain::dist::ProcessGroup& world) {
  torch::NoGradGuard no_grad;
  std::vector<const torch::nn::Module*> mine;
  for (const auto& stage : pipe.stages())
    for (const auto& child : stage.module->children()) mine.push_back(child.get());
  for (const auto& layer : layers->children()) {
    const bool owner = replica0 && std::find(mine.begin(), mine.end(), layer.get()) != mine.end();
    for (auto& p : layer->parameters()) {
      at::Tensor t = owner ? p.detach().clone() : at::zeros_like(p);
      world.all_reduce(t).wait();
      p.copy_(t);
    }
  }
}

inline int train_pipeline(const PipelineRun& run, const Corpus& corpus) {
  DTRAIN_CHECK(dtrain::dist::launched_by_launcher(), ConfigError,
               "--strategy pipeline runs one process per stage, but RANK and WORLD_SIZE are not set.",
               "start it through a launcher: dtrain run --nproc-per-node 2 gpt --strategy pipeline");
  at::set_num_threads(1);
  auto world = dtrain::dist::init_process_group();
  dtrain::dist::DeviceMesh mesh(world, run.pipeline.mesh_dims(world.size()));
  torch::nn::Sequential layers = gpt_layers(run.model);
  init_weights(*layers, run.model.n_layer, run.seed);
  auto& data = mesh.join({"dp_replicate", "dp_shard"});
  const int replicas = data.size(), replica = data.rank(), pp_index = mesh.coordinate("pp");
  dtrain::pipeline::Pipeline pipe(pipeline_stages(layers, mesh.size("pp"), run.pipeline.stages_per_rank(), pp_index),
                                  mesh["pp"], run.pipeline.options(mesh), lm_loss);
  // Sharded stages: the optimizer steps on 1-D shards, so which decay is
  // decided on their full parameters; and the full parameters are brought up
  // to date (all-gathered) before anything reads them.
  std::function<bool(const at::Tensor&)> decays;
  const std::vector<dtrain::ShardedDataParallel*> sharded = pipe.sharded_stages();
  if (!sharded.empty()) {
    std::vector<std::function<bool(const at::Tensor&)>> each;
    for (const auto* sdp : sharded) each.push_back(zero_decays(*sdp));
    decays = [each](const at::Tensor& p) {
      return std::any_of(each.begin(), each.end(), [&](const auto& d) { return d(p); });
    };
  }
  auto gather_full = [&] {
    for (auto* sdp : sharded) sdp->pre_forward();
  };
  auto optimizer = run.make_optimizer(pipe.parameters(), decays);
  const bool lead = world.rank() == 0;
  const bool loss_here = replica == 0 && pipe.schedule().rank_of_stage(pipe.schedule().stage_count() - 1) == pp_index;
  // Sum over the world of a value only one rank has.
  auto from_loss_rank = [&](double value) {
    at::Tensor t = at::full({1}, loss_here ? value : 0.0, at::kDouble);
    world.all_reduce(t).wait();
    return t.item<double>();
  };

  // One checkpoint for the whole world: every rank writes its stages and its
  // optimizer as its own part, and the checkpoint is committed once all have
  // (Note [Checkpoint commit] in src/trainer/checkpoint.cpp), so the stages
  // always resume from the same step.
  StagesHolder holder(pipe);
  std::optional<dtrain::Checkpointer> checkpoints;
  std::int64_t start = 0;
  if (!run.checkpoint_dir.empty()) {
    checkpoints.emplace(dtrain::CheckpointOptions{.dir = run.checkpoint_dir}, world);
    checkpoints->add_state("stages", dtrain::module_state(*holder), dtrain::StateScope::kPerRank);
    checkpoints->add_state("stage_optimizer", dtrain::optimizer_state(*optimizer), dtrain::StateScope::kPerRank);
    if (auto resumed = checkpoints->load_latest()) start = resumed->step;
    if (start > 0) {
      DTRAIN_LOG(kInfo) << "resumed at step " << start;
    }
  }

  const std::int64_t global = run.batch_size * replicas;
  auto evaluate = [&](std::int64_t step, double train_loss) {
    double sum = 0;
    for (std::int64_t k = 0; k < run.eval_iters; ++k) {
      const auto b = make_batch(*corpus.val, draw_windows(corpus.val->size(), global, val_batch_seed(run.seed, k)));
      const at::Tensor logits = pipe.forward(b.data);
      if (logits.defined()) sum += lm_loss(logits, b.target).item<double>();
    }
    const double val = from_loss_rank(sum) / double(run.eval_iters);
    if (lead)
      std::cout
          << nlohmann::json{{"event", "eval"}, {"step", step}, {"train_loss", train_loss}, {"val_loss", val}}.dump()
          << std::endl;
    return val;
  };
  const char* kill_at = std::getenv("DTRAIN_GPT_KILL_LAST_STAGE_AT");
  const bool may_kill = kill_at != nullptr && dtrain::dist::read_env_contract().restart_count == 0 &&
                        pipe.schedule().rank_of_stage(pipe.schedule().stage_count() - 1) == pp_index;
  double val_loss = NAN, loss_sum = 0, seconds = 0;
  std::int64_t loss_count = 0, trained = 0;
  dtrain::Progress progress(run.max_iters, {.label = "train", .enabled = lead});
  for (std::int64_t step = start; step < run.max_iters; ++step) {
    if (step % run.eval_interval == 0) {
      val_loss = evaluate(step, loss_count ? from_loss_rank(loss_sum) / double(loss_count) : NAN);
      loss_sum = 0;
      loss_count = 0;
    }
    if (may_kill && step == std::atoll(kill_at)) std::raise(SIGKILL);
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& group : optimizer->param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(run.learning_rate(step));
    const at::Tensor offsets = draw_windows(corpus.train->size(), global, train_batch_seed(run.seed, step));
    const auto b =
        make_batch(*corpus.train, offsets.slice(0, replica * run.batch_size, (replica + 1) * run.batch_size));
    const at::Tensor loss = pipe.step(b.data, b.target);
    if (run.grad_clip > 0) pipe.clip_grad_norm_(run.grad_clip);
    optimizer->step();
    pipe.zero_grad();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++trained;
    if (loss.defined()) loss_sum += loss.item<double>();
    ++loss_count;
    progress.update(step + 1);  // the loss lives on the last stage, not rank 0
    if (checkpoints && (step + 1) % run.eval_interval == 0) {
      gather_full();
      checkpoints->save({.step = step + 1, .sampler = {}});
    }
  }
  progress.finish();
  val_loss = evaluate(run.max_iters, loss_count ? from_loss_rank(loss_sum) / double(loss_count) : NAN);
  if (checkpoints && run.max_iters % run.eval_interval != 0) checkpoints->save({.step = run.max_iters, .sampler = {}});
  gather_full();
  if (!run.save_params.empty() && replica == 0) {
    const auto stages = pipe.schedule().stages_of_rank(pp_index);
    for (std::size_t k = 0; k < stages.size(); ++k) {
      std::ofstream out(run.save_params + ".stage" + std::to_string(stages[k]), std::ios::binary);
      for (const auto& p : pipe.stages()[k].module->parameters()) {
        const at::Tensor t = p.detach().to(at::kCPU, at::kFloat).contiguous();
        out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
      }
    }
  }
  std::string sample;
  if (run.sample.tokens > 0) {
    gather_layers(layers, pipe, replica == 0, world);
    if (lead) {
      layers->eval();
      sample = generate(
          run.sample, corpus, [&](const at::Tensor& x) { return layers->forward(x); }, c10::kCPU);
    }
  }
  world.barrier();
  if (lead) {
    if (!sample.empty()) print_sample(std::cout, run.sample, sample);
    std::cout << nlohmann::json{{"event", "done"},
                                {"strategy", "pipeline"},
                                {"schedule", run.pipeline.schedule},
                                {"mesh", mesh.describe()},
                                {"dp_reduce", replicas > 1 ? run.pipeline.dp_reduce : "none"},
                                {"world_size", world.size()},
                                {"steps", run.max_iters},
                                {"val_loss", val_loss},
                                {"tokens_per_second",
                                 trained ? double(global * run.model.block_size * trained) / seconds : 0.0}}
                     .dump()
              << std::endl;
  }
  return 0;
}

}  // namespace gpt
