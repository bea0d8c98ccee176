// DP x PP 2 x 2 on 4 processes, each stage's gradients synchronised over its
// data-parallel group by each applier (DDP; ZeRO 1, 2 and 3 per stage), for
// every schedule (gpipe, 1f1b, interleaved with 2 stages per rank, zb):
// three AdamW steps with global-norm clipping, then an evaluation, equal one
// process training the same model on the union batch (rtol 1e-5). The model
// has odd sizes, so ZeRO's units are padded and its shards uneven. ZeRO-3
// holds a stage's full parameters once during a step and frees them after.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "appliers_model.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "ranks.h"

namespace {

using appliers_model::appliers_net;
using appliers_model::kClasses;
using appliers_model::kIn;

at::Tensor appliers_loss(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

struct AppliersBatch {
  at::Tensor x, y;
};
AppliersBatch appliers_batch(int size, int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {at::randn({size, kIn}, gen), at::randint(0, kClasses, {size}, gen)};
}

bool appliers_close(const at::Tensor& a, const at::Tensor& b, const std::string& what, std::ostream& failures) {
  if (a.sizes() == b.sizes() && at::allclose(a, b, 1e-5, 1e-6)) return true;
  failures << what << ": max difference " << (a.sizes() == b.sizes() ? (a - b).abs().max().item<double>() : -1.0)
           << "\n";
  return false;
}

}  // namespace

TEST(PipelineAppliers, DataTimesPipelineWithEachApplierAndScheduleEqualsOneProcess) {
  using dtrain::pipeline::ScheduleKind;
  constexpr int kWorld = 4, kSteps = 3, kBatch = 12, kMicro = 2;
  constexpr double kMaxNorm = 0.1, kLr = 0.02;
  dtrain::testing::run_rank_processes(
      kWorld,
      [&](int rank) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(60)});
        dtrain::dist::DeviceMesh replicated(world, {{"pp", 2}, {"dp_replicate", 2}});
        dtrain::dist::DeviceMesh sharded(world, {{"pp", 2}, {"dp_shard", 2}});
        struct Applier {
          const char* name;
          dtrain::pipeline::StageSyncFactory sync;
          dtrain::dist::DeviceMesh* mesh;
          const char* dim;
        };
        const Applier appliers[] = {
            {"ddp", dtrain::pipeline::ddp_stage_sync(), &replicated, "dp_replicate"},
            {"zero1", dtrain::pipeline::zero_stage_sync({.stage = 1}), &sharded, "dp_shard"},
            {"zero2", dtrain::pipeline::zero_stage_sync({.stage = 2}), &sharded, "dp_shard"},
            {"zero3", dtrain::pipeline::zero_stage_sync({.stage = 3}), &sharded, "dp_shard"},
        };
        std::ostringstream failures;
        int checked = 0;
        for (const ScheduleKind kind :
             {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubble}) {
          for (const Applier& applier : appliers) {
            dtrain::dist::DeviceMesh& mesh = *applier.mesh;
            const int v = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
            const std::string where = to_string(kind) + " " + applier.name + " rank " + std::to_string(rank);
            torch::nn::Sequential net = appliers_net();
            const std::vector<std::size_t> cut =
                v == 2 ? std::vector<std::size_t>{0, 1, 2, 3} : std::vector<std::size_t>{0, 0, 1, 1};
            const auto stages = dtrain::pipeline::split_stages(net, cut);
            const int pp = mesh.coordinate("pp");
            std::vector<dtrain::pipeline::PipelineStage> mine;
            for (int k = 0; k < v; ++k) mine.push_back({.module = stages[pp + 2 * k]});
            auto pipe = std::make_unique<dtrain::pipeline::Pipeline>(
                std::move(mine), mesh["pp"],
                dtrain::pipeline::PipelineOptions{.schedule = kind,
                                                  .micro_batches = kMicro,
                                                  .data_parallel_group = mesh[applier.dim],
                                                  .stage_sync = applier.sync},
                appliers_loss);
            torch::optim::AdamW opt(pipe->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.1));
            torch::nn::Sequential reference = appliers_net();
            torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.1));
            const int dp = mesh.coordinate(applier.dim);
            for (int step = 0; step < kSteps; ++step) {
              const AppliersBatch b = appliers_batch(kBatch, step);
              const auto half = [&](const at::Tensor& t) { return t.chunk(2, 0)[dp]; };
              pipe->zero_grad();
              for (auto* sdp : pipe->sharded_stages()) sdp->reset_peak();
              const at::Tensor loss = pipe->step(half(b.x), half(b.y));
              // ZeRO-3: during the step the stage held its full parameters (units
              // padded to 2 equal slices: 2 chunks' bytes) beside its chunks,
              // after it only the chunks.
              for (auto* sdp : pipe->sharded_stages()) {
                if (sdp->options().stage != 3) continue;
                const dtrain::ZeroMemoryStats m = sdp->memory_stats();
                if (m.peak_parameter_bytes != 3 * m.parameter_bytes)
                  failures << where << ": parameter bytes " << m.parameter_bytes << " after the step, peak "
                           << m.peak_parameter_bytes
                           << " (expected 3x: the chunks, and the full parameters during the step)\n";
              }
              const at::Tensor norm = pipe->clip_grad_norm_(kMaxNorm);
              opt.step();
              ref_opt.zero_grad();
              const at::Tensor ref_loss = appliers_loss(reference->forward(b.x), b.y);
              ref_loss.backward();
              const at::Tensor ref_norm = dtrain::clip_grad_norm_(reference->parameters(), kMaxNorm);
              ref_opt.step();
              if (step == 0 && ref_norm.item<double>() <= kMaxNorm) failures << where << ": clipping did not act\n";
              appliers_close(norm, ref_norm, where + " norm at step " + std::to_string(step), failures);
              // The replica's mean loss: half the batch; the reference's over both halves.
              if (loss.defined()) {
                at::Tensor both = loss.detach().reshape({1}).clone();
                mesh[applier.dim].all_reduce(both, dtrain::dist::ReduceOp::kAvg).wait();
                appliers_close(both.reshape({}), ref_loss.detach(), where + " loss at step " + std::to_string(step),
                               failures);
              }
            }
            const AppliersBatch eval = appliers_batch(6, 99);
            const at::Tensor out = pipe->forward(eval.x);
            if (out.defined()) {
              at::NoGradGuard no_grad;
              appliers_close(out, reference->forward(eval.x), where + " eval output", failures);
            }
            {
              std::vector<std::unique_ptr<dtrain::ShardedDataParallel::FullParameters>> full;
              for (auto* sdp : pipe->sharded_stages())
                full.push_back(std::make_unique<dtrain::ShardedDataParallel::FullParameters>(*sdp));
              if (std::string(applier.name) != "ddp" && full.size() != std::size_t(v))
                failures << where << ": " << full.size() << " sharded stages\n";
              auto ref_params = reference->named_parameters();
              for (const auto& stage : pipe->stages()) {
                for (const auto& item : stage.module->named_parameters()) {
                  appliers_close(item.value().detach(), ref_params[item.key()].detach(), where + " " + item.key(),
                                 failures);
                  ++checked;
                }
              }
            }
          }
        }
        EXPECT_GT(checked, 0);
        EXPECT_TRUE(failures.str().empty()) << failures.str();
        if (!failures.str().empty()) std::cerr << failures.str();
      },
      {.timeout = std::chrono::seconds(300)});
}

// A step whose loss throws (on every rank alike) ends its stages' scopes: a
// ZeRO-3 stage is resharded after the error, not left gathered for the next
// step to run inside, and the next step trains as if the failed one had not
// happened (equal to one process that never saw it).
TEST(PipelineAppliers, AStepThatThrowsEndsItsStagesScopes) {
  constexpr int kWorld = 2, kBatch = 8;
  dtrain::testing::run_rank_processes(
      kWorld,
      [&](int rank) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(60)});
        dtrain::dist::DeviceMesh mesh(world, {{"pp", 1}, {"dp_shard", 2}});
        torch::nn::Sequential net = appliers_net();
        auto stages = dtrain::pipeline::split_stages(net, {0, 0, 0, 0});
        bool fail = true;
        auto loss_fn = [&fail](const at::Tensor& out, const at::Tensor& y) {
          if (fail) throw std::runtime_error("loss failed on purpose");
          return appliers_loss(out, y);
        };
        dtrain::pipeline::Pipeline pipe({{.module = stages[0]}}, mesh["pp"],
                                        {.schedule = dtrain::pipeline::ScheduleKind::kGPipe,
                                         .micro_batches = 2,
                                         .data_parallel_group = mesh["dp_shard"],
                                         .stage_sync = dtrain::pipeline::zero_stage_sync({.stage = 3})},
                                        loss_fn);
        ASSERT_EQ(pipe.sharded_stages().size(), 1u);
        dtrain::ShardedDataParallel& sdp = *pipe.sharded_stages().front();
        const std::int64_t chunks = sdp.memory_stats().parameter_bytes;
        const auto half = [&](const at::Tensor& t) { return t.chunk(2, 0)[mesh.coordinate("dp_shard")]; };
        const AppliersBatch failing = appliers_batch(kBatch, 0);
        EXPECT_THROW(pipe.step(half(failing.x), half(failing.y)), std::runtime_error) << "rank " << rank;
        EXPECT_EQ(sdp.memory_stats().parameter_bytes, chunks)
            << "rank " << rank << ": the failed step left the stage's full parameters gathered";

        fail = false;
        torch::optim::AdamW opt(pipe.parameters(), torch::optim::AdamWOptions(0.02));
        torch::nn::Sequential reference = appliers_net();
        torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(0.02));
        const AppliersBatch b = appliers_batch(kBatch, 1);
        pipe.zero_grad();
        pipe.step(half(b.x), half(b.y));
        opt.step();
        appliers_loss(reference->forward(b.x), b.y).backward();
        ref_opt.step();
        EXPECT_EQ(sdp.memory_stats().parameter_bytes, chunks) << "rank " << rank;
        dtrain::ShardedDataParallel::FullParameters full(sdp);
        auto ref_params = reference->named_parameters();
        std::ostringstream failures;
        for (const auto& item : stages[0]->named_parameters())
          appliers_close(item.value().detach(), ref_params[item.key()].detach(), item.key(), failures);
        EXPECT_TRUE(failures.str().empty()) << "rank " << rank << "\n" << failures.str();
      },
      {.timeout = std::chrono::seconds(120)});
}
