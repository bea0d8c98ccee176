// dtrain::parallelize on 4 processes: for each plan (DDP; ZeRO 1, 2, 3; HSDP
// 2 x 2; DP x PP 2 x 2 with DDP and with ZeRO-2 per stage), a model with odd
// widths and a tied weight (appliers_model.h: its last layer reads the first
// layer's weight) trained by the Trainer for three AdamW steps with
// global-norm clipping and weight decay on the matrices only
// (Parallelized::is_matrix, which ZeRO decides on full parameters), read back
// through full_weights() on rank 0, equals one process training the same
// layers on the union batch (rtol 1e-5). A plan with an axis the model gives
// no part for (tp) is a ConfigError naming it. A pipeline rank, and a tp rank
// beside its split, hold only the weights they train (the others' storage is
// released), and still read the whole model, trained, through full_weights().
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <unordered_set>

#include "appliers_model.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/data/loader.h"
#include "dtrain/dist/clip.h"
#include "dtrain/error.h"
#include "dtrain/trainer/parallelize.h"
#include "dtrain/trainer/trainer.h"
#include "ranks.h"

namespace {

using appliers_model::kIn;

constexpr int kParallelizeSteps = 3;
constexpr std::int64_t kParallelizeBatch = 12;  // the union batch of every step
constexpr double kParallelizeMaxNorm = 0.05, kParallelizeLr = 0.02;

// Step s's union batch: kIn classes (the tied head's).
dtrain::data::TensorBatch parallelize_batch(std::int64_t step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(700 + step);
  at::Tensor x = at::randn({kParallelizeBatch, kIn}, gen);
  return {x, at::randint(0, kIn, {kParallelizeBatch}, gen)};
}

// The Trainer's source: each rank's rows of step s's union batch, by data
// rank and micro-step.
std::shared_ptr<dtrain::StepStream> parallelize_source() {
  return std::make_shared<dtrain::StepStream>([](const dtrain::StepStream::Request& r) {
    const auto b = parallelize_batch(r.step);
    const std::int64_t first = (r.micro * r.data_world + r.data_rank) * r.batch_size;
    return dtrain::data::TensorBatch{b.data.slice(0, first, first + r.batch_size),
                                     b.target.slice(0, first, first + r.batch_size)};
  });
}

// AdamW decaying `is_matrix` parameters only.
std::unique_ptr<torch::optim::AdamW> parallelize_adamw(const std::vector<at::Tensor>& params,
                                                       const std::function<bool(const at::Tensor&)>& is_matrix) {
  std::vector<at::Tensor> decay, rest;
  for (const auto& p : params) (is_matrix(p) ? decay : rest).push_back(p);
  const auto adamw = torch::optim::AdamWOptions(kParallelizeLr);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(adamw).weight_decay(0.1)));
  groups.emplace_back(
      rest, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(adamw).weight_decay(0.0)));
  return std::make_unique<torch::optim::AdamW>(groups, adamw);
}

// The model's parts: the layers under "net"; ZeRO units 1 and 2 (the tied
// layers 0 and 3 in the root unit, gathered for the whole step); pipeline
// stages with the tie between the first and last stage.
dtrain::ModelParts parallelize_parts() {
  dtrain::ModelParts parts{.layers = [] { return appliers_model::tied_appliers_net(); }, .name = "net"};
  parts.zero_unit = [](const std::string& name, const torch::nn::Module&) {
    return name == "net.1" || name == "net.2";
  };
  parts.pipeline_stages = [](const torch::nn::Sequential& layers, const dtrain::StageCut& cut) {
    const int n = cut.ranks * cut.stages_per_rank;
    const auto all = dtrain::pipeline::split_stages(
        layers, cut.stage_of_layer.empty() ? dtrain::pipeline::plan_stages(layers, n) : cut.stage_of_layer);
    const at::Tensor first = layers->ptr<appliers_model::AppliersTanhLinearImpl>(0)->linear->weight;
    const at::Tensor read = layers->ptr<appliers_model::AppliersTiedHeadImpl>(3)->tied->weight;
    std::vector<dtrain::pipeline::PipelineStage> mine;
    for (int s = cut.rank; s < n; s += cut.ranks) {
      dtrain::pipeline::PipelineStage stage{.module = all[s]};
      if (s == 0 && n > 1) stage.tied.push_back({.parameter = first, .other_stage = n - 1, .owner = true});
      if (s == n - 1) stage.tied.push_back({.parameter = read, .other_stage = 0, .owner = n == 1});
      mine.push_back(std::move(stage));
    }
    return mine;
  };
  return parts;
}

// One process on the union batches: the parameters under parallelize's names.
std::map<std::string, at::Tensor> parallelize_reference() {
  torch::nn::Sequential net = appliers_model::tied_appliers_net();
  auto opt = parallelize_adamw(net->parameters(), [](const at::Tensor& p) { return p.dim() >= 2; });
  for (std::int64_t step = 0; step < kParallelizeSteps; ++step) {
    const auto b = parallelize_batch(step);
    opt->zero_grad();
    torch::nn::functional::cross_entropy(net->forward(b.data), b.target).backward();
    const at::Tensor norm = dtrain::clip_grad_norm_(net->parameters(), kParallelizeMaxNorm);
    EXPECT_TRUE(step > 0 || norm.item<double>() > kParallelizeMaxNorm) << "clipping did not act";
    opt->step();
  }
  std::map<std::string, at::Tensor> named;
  for (const auto& item : net->named_parameters()) named["net." + item.key()] = item.value().detach().clone();
  return named;
}

// A tp "split" that copies the whole model (every parameter Replicate, the
// default layout): each tp rank trains the union batch as one process does,
// and parallelize's full copy shares nothing with it.
dtrain::ModelParts copying_tp_parts() {
  dtrain::ModelParts parts = parallelize_parts();
  parts.tp.split = [](const torch::nn::Sequential& full, dtrain::dist::DeviceMesh&) {
    torch::nn::Sequential copy = appliers_model::tied_appliers_net();
    torch::NoGradGuard no_grad;
    const auto from = full->parameters();
    const auto to = copy->parameters();
    for (std::size_t k = 0; k < to.size(); ++k) to[k].copy_(from[k]);
    return copy;
  };
  parts.tp.loss = [](dtrain::dist::DeviceMesh&) -> dtrain::ModelLossFn {
    return [](const at::Tensor& out, const at::Tensor& target) {
      return torch::nn::functional::cross_entropy(out, target);
    };
  };
  return parts;
}

// Bytes of storage `params` hold (each parameter once; a released one none).
std::int64_t resident_bytes(const std::vector<at::Tensor>& params) {
  std::unordered_set<const void*> seen;
  std::int64_t total = 0;
  for (const at::Tensor& p : params) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (p.has_storage() && p.storage().nbytes() > 0) total += p.numel() * static_cast<std::int64_t>(p.element_size());
  }
  return total;
}

// What a rank trains (or reads, a tie it borrows) of the whole model: its
// stages' parameters and ties under a pipeline, none of the full copy under
// tp (the split is a copy).
std::vector<at::Tensor> trained_here(const dtrain::Parallelized& run) {
  std::vector<at::Tensor> out;
  if (!run.pipeline) return out;
  for (const auto& stage : run.pipeline->stages()) {
    for (const auto& p : stage.module->parameters()) out.push_back(p);
    for (const auto& tied : stage.tied) out.push_back(tied.parameter);
  }
  return out;
}

struct ParallelizeCase {
  const char* name;
  dtrain::ParallelPlan plan;
};

}  // namespace

TEST(Parallelize, EveryDataAndPipelinePlanEqualsOneProcess) {
  const dtrain::PipelinePlan two_micro{.schedule = "1f1b", .micro_batches = 2};
  const ParallelizeCase cases[] = {
      {"ddp", {.dp_replicate = 4}},
      {"zero1", {.dp_shard = 4, .zero_stage = 1}},
      {"zero2", {.dp_shard = 4, .zero_stage = 2}},
      {"zero3", {.dp_shard = 4, .zero_stage = 3}},
      {"hsdp 2x2", {.dp_replicate = 2, .dp_shard = 2, .zero_stage = 3}},
      {"dp x pp 2x2 ddp", {.pp = 2, .dp_replicate = 2, .pipeline = two_micro}},
      {"dp x pp 2x2 zero2", {.pp = 2, .dp_shard = 2, .zero_stage = 2, .pipeline = two_micro}},
  };
  dtrain::testing::run_rank_processes(
      4,
      [&](int rank) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(60)});
        const auto reference = parallelize_reference();
        std::ostringstream failures;
        int checked = 0;
        for (const ParallelizeCase& c : cases) {
          c.plan.validate({.world = 4, .model = {.layers = 4}});
          dtrain::Parallelized run = dtrain::parallelize(parallelize_parts(), c.plan, world);
          auto opt = parallelize_adamw(run.strategy->parameters(), run.is_matrix);
          auto source = parallelize_source();
          const std::int64_t per_rank = kParallelizeBatch / c.plan.data_parallel();
          dtrain::Trainer trainer(run.strategy, *opt, source,
                                  {.max_steps = kParallelizeSteps,
                                   .batch_size = per_rank,
                                   .clip_norm = kParallelizeMaxNorm,
                                   .progress = false});
          trainer.set_loss(run.loss);
          const auto summary = trainer.fit();
          if (summary.steps != kParallelizeSteps) failures << c.name << ": " << summary.steps << " steps\n";
          auto full = run.full_weights();
          if (rank != 0) continue;
          for (const auto& item : run.whole->named_parameters()) {
            const auto want = reference.find(item.key());
            if (want == reference.end()) {
              failures << c.name << ": no reference for " << item.key() << "\n";
              continue;
            }
            const at::Tensor got = item.value().detach();
            ++checked;
            if (got.sizes() != want->second.sizes() || !at::allclose(got, want->second, 1e-5, 1e-6))
              failures << c.name << " (" << run.applier << ") " << item.key() << ": max difference "
                       << (got.sizes() == want->second.sizes() ? (got - want->second).abs().max().item<double>() : -1.0)
                       << "\n";
          }
        }
        if (rank == 0) {
          EXPECT_EQ(checked, 7 * 7);  // seven parameters (the tie counted once) per plan
        }
        EXPECT_TRUE(failures.str().empty()) << failures.str();
        if (!failures.str().empty()) std::cerr << failures.str();
      },
      {.timeout = std::chrono::seconds(240)});
}

TEST(Parallelize, PipelineAndTpRanksHoldOnlyTheWeightsTheyTrain) {
  const ParallelizeCase cases[] = {
      {"pp 2 1f1b", {.pp = 2, .pipeline = {.schedule = "1f1b", .micro_batches = 2}}},
      {"pp 2 interleaved",
       {.pp = 2, .pipeline = {.schedule = "interleaved", .stages_per_rank = 2, .micro_batches = 2}}},
      {"tp 2 (a copying split)", {.tp = 2}},
  };
  dtrain::testing::run_rank_processes(
      2,
      [&](int rank) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(60)});
        const auto reference = parallelize_reference();
        std::int64_t whole_bytes = 0;
        for (const auto& [name, t] : reference) whole_bytes += t.numel() * static_cast<std::int64_t>(t.element_size());
        for (const ParallelizeCase& c : cases) {
          SCOPED_TRACE(c.name);
          c.plan.validate({.world = 2, .model = {.layers = 4}});
          dtrain::Parallelized run = dtrain::parallelize(copying_tp_parts(), c.plan, world);
          const std::int64_t mine = resident_bytes(trained_here(run));
          EXPECT_EQ(resident_bytes(run.whole->parameters()), mine)
              << "rank " << rank << " holds weights it does not train";
          EXPECT_LT(mine, whole_bytes) << "rank " << rank << " trains the whole model";
          auto opt = parallelize_adamw(run.strategy->parameters(), run.is_matrix);
          auto source = parallelize_source();
          dtrain::Trainer trainer(run.strategy, *opt, source,
                                  {.max_steps = kParallelizeSteps,
                                   .batch_size = kParallelizeBatch,
                                   .clip_norm = kParallelizeMaxNorm,
                                   .progress = false});
          trainer.set_loss(run.loss);
          EXPECT_EQ(trainer.fit().steps, kParallelizeSteps);
          EXPECT_EQ(resident_bytes(run.whole->parameters()), mine) << "rank " << rank << " after training";
          for (int twice = 0; twice < 2; ++twice) {  // the scope releases what it brought back, and can again
            auto full = run.full_weights();
            EXPECT_EQ(resident_bytes(run.whole->parameters()), whole_bytes) << "rank " << rank;
            if (rank == 0) {
              for (const auto& item : run.whole->named_parameters()) {
                const at::Tensor& want = reference.at(item.key());
                const at::Tensor got = item.value().detach();
                ASSERT_EQ(got.sizes(), want.sizes()) << item.key();
                EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6))
                    << item.key() << ": max difference " << (got - want).abs().max().item<double>();
              }
            }
          }
          EXPECT_EQ(resident_bytes(run.whole->parameters()), mine) << "rank " << rank << " after full_weights()";
        }
      },
      {.timeout = std::chrono::seconds(240)});
}

TEST(Parallelize, AnAxisTheModelGivesNoPartForIsRefusedByName) {
  dtrain::testing::run_rank_processes(
      2,
      [](int) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(30)});
        const dtrain::ParallelPlan plan{.tp = 2};
        try {
          dtrain::parallelize(parallelize_parts(), plan, world);
          ADD_FAILURE() << "tp 2 without a tensor-parallel split was accepted";
        } catch (const dtrain::ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find("no tensor-parallel split"), std::string::npos) << e.what();
        }
      },
      {.timeout = std::chrono::seconds(60)});
}
