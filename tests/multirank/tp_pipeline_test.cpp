// Tensor-parallel pipeline stages: the composition tests' model (blocks of
// dtrain::nn column- and row-parallel layers, odd sizes) cut into 2 stages,
//  - pp 2 x tp 2 on 4 processes, every schedule (gpipe, 1f1b, interleaved
//    with 2 stages per rank, zb);
//  - the 4-D plan's data, tensor and pipeline axes, dp_shard 2 x tp 2 x pp 2
//    on 8 processes, ZeRO 1, 2 and 3 per stage over dp_shard (1f1b, gpipe,
//    zb), and dp_replicate 2 x tp 2 x pp 2 with DDP per stage (interleaved);
// three AdamW steps with global-norm clipping (acting) through
// Pipeline::clip_grad_norm_ (norms from the layouts: PipelineOptions::mesh),
// then an evaluation, equal one process on the union batch (rtol 1e-5).
// Activations between stages are tp-replicated (the row layers' all-reduced
// outputs): each tp rank sends to the tp rank of its coordinate in the next
// stage.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <iostream>
#include <memory>
#include <sstream>

#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "ranks.h"
#include "tp_compose_model.h"

using namespace dtrain::testing::tp_compose;

namespace {

struct TpPipelineCase {
  dtrain::pipeline::ScheduleKind kind;
  dtrain::pipeline::StageSyncFactory sync;  // unset: no data group
  std::string name;
  std::string data_dim;  // the data-parallel dimension with `sync`
};

// Trains `c` on `mesh` (pp, tp, and c.data_dim when c.sync is set) against the
// reference; failures and the number of parameters compared go to the caller.
int train_tp_pipeline(dtrain::dist::DeviceMesh& mesh, const TpPipelineCase& c, std::ostream& failures) {
  using dtrain::pipeline::ScheduleKind;
  constexpr int kSteps = 3, kBatch = 20, kMicro = 2;
  constexpr double kMaxNorm = 0.1, kLr = 0.02;
  const std::string where = c.name + " rank " + std::to_string(mesh.group().rank());
  const int v = c.kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
  torch::nn::Sequential net = tp_net(mesh);
  const std::vector<std::size_t> cut =
      v == 2 ? std::vector<std::size_t>{0, 1, 2, 3} : std::vector<std::size_t>{0, 0, 1, 1};
  const auto stages = dtrain::pipeline::split_stages(net, cut);
  const int pp = mesh.coordinate("pp");
  std::vector<dtrain::pipeline::PipelineStage> mine;
  for (int k = 0; k < v; ++k) mine.push_back({.module = stages[pp + 2 * k]});
  dtrain::pipeline::PipelineOptions options{.schedule = c.kind, .micro_batches = kMicro, .mesh = mesh};
  const bool sharded = static_cast<bool>(c.sync);  // a data-parallel group (ZeRO or DDP)
  if (sharded) {
    options.data_parallel_group = mesh[c.data_dim];
    options.stage_sync = c.sync;
  }
  auto pipe = std::make_unique<dtrain::pipeline::Pipeline>(std::move(mine), mesh["pp"], options, compose_loss);
  torch::optim::AdamW opt(pipe->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.1));
  torch::nn::Sequential reference = reference_net();
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.1));
  const int dp = sharded ? mesh.coordinate(c.data_dim) : 0;
  const int replicas = sharded ? 2 : 1;
  for (int step = 0; step < kSteps; ++step) {
    const ComposeBatch b = compose_batch(kBatch, step);
    const auto part = [&](const at::Tensor& t) { return t.chunk(replicas, 0)[dp]; };
    pipe->zero_grad();
    const at::Tensor loss = pipe->step(part(b.x), part(b.y));
    const at::Tensor norm = pipe->clip_grad_norm_(kMaxNorm);
    opt.step();
    ref_opt.zero_grad();
    const at::Tensor ref_loss = compose_loss(reference->forward(b.x), b.y);
    ref_loss.backward();
    const at::Tensor ref_norm = dtrain::clip_grad_norm_(reference->parameters(), kMaxNorm);
    ref_opt.step();
    if (step == 0 && ref_norm.item<double>() <= kMaxNorm) failures << where << ": clipping did not act\n";
    compose_close(norm, ref_norm, where + " norm at step " + std::to_string(step), failures);
    if (loss.defined()) {
      at::Tensor both = loss.detach().reshape({1}).clone();
      if (sharded) mesh[c.data_dim].all_reduce(both, dtrain::dist::ReduceOp::kAvg).wait();
      compose_close(both.reshape({}), ref_loss.detach(), where + " loss at step " + std::to_string(step), failures);
    }
  }
  const ComposeBatch eval = compose_batch(6, 99);
  const at::Tensor out = pipe->forward(eval.x);
  if (out.defined()) {
    at::NoGradGuard no_grad;
    compose_close(out, reference->forward(eval.x), where + " eval output", failures);
  }
  std::vector<std::unique_ptr<dtrain::ShardedDataParallel::FullParameters>> full;
  for (auto* sdp : pipe->sharded_stages())
    full.push_back(std::make_unique<dtrain::ShardedDataParallel::FullParameters>(*sdp));
  if (c.data_dim == "dp_shard" && full.size() != std::size_t(v))
    failures << where << ": " << full.size() << " sharded stages\n";
  int compared = 0;
  for (const auto& stage : pipe->stages()) compared += compare_parts(*stage.module, mesh, reference, where, failures);
  return compared;
}

void expect_no_failures(const std::ostringstream& failures) {
  EXPECT_TRUE(failures.str().empty()) << failures.str();
  if (!failures.str().empty()) std::cerr << failures.str();
}

}  // namespace

TEST(TpCompose, TensorParallelPipelineStagesEqualOneProcessUnderEverySchedule) {
  using dtrain::pipeline::ScheduleKind;
  dtrain::testing::run_rank_processes(
      4,
      [&](int /*rank*/) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(60)});
        dtrain::dist::DeviceMesh mesh(world, {{"pp", 2}, {"tp", 2}});
        std::ostringstream failures;
        for (const ScheduleKind kind :
             {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubble}) {
          const int compared = train_tp_pipeline(mesh, {.kind = kind, .name = to_string(kind)}, failures);
          if (compared == 0) failures << to_string(kind) << ": nothing compared\n";
        }
        expect_no_failures(failures);
      },
      {.timeout = std::chrono::seconds(180)});
}

// The 4-D plan's statement without cp: dp_shard 2 x tp 2 x pp 2 on 8
// processes (ZeRO 1, 2, 3 per stage under 1f1b, gpipe and zb), and the
// replicated variant dp_replicate 2 x tp 2 x pp 2 (DDP per stage,
// interleaved).
TEST(TpCompose, DataTimesTensorTimesPipelineEqualsOneProcess) {
  using dtrain::pipeline::ScheduleKind;
  using dtrain::pipeline::zero_stage_sync;
  dtrain::testing::run_rank_processes(
      8,
      [&](int /*rank*/) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(90)});
        dtrain::dist::DeviceMesh sharded(world, {{"pp", 2}, {"dp_shard", 2}, {"tp", 2}});
        dtrain::dist::DeviceMesh replicated(world, {{"pp", 2}, {"dp_replicate", 2}, {"tp", 2}});
        const TpPipelineCase cases[] = {
            {ScheduleKind::k1F1B, zero_stage_sync({.stage = 1, .mesh = sharded}), "1f1b zero1", "dp_shard"},
            {ScheduleKind::kGPipe, zero_stage_sync({.stage = 3, .mesh = sharded}), "gpipe zero3", "dp_shard"},
            {ScheduleKind::kZeroBubble, zero_stage_sync({.stage = 2, .mesh = sharded}), "zb zero2", "dp_shard"},
            {ScheduleKind::kInterleaved1F1B, dtrain::pipeline::ddp_stage_sync(), "interleaved ddp", "dp_replicate"},
        };
        std::ostringstream failures;
        for (const TpPipelineCase& c : cases) {
          dtrain::dist::DeviceMesh& mesh = c.data_dim == "dp_shard" ? sharded : replicated;
          if (train_tp_pipeline(mesh, c, failures) == 0) failures << c.name << ": nothing compared\n";
        }
        expect_no_failures(failures);
      },
      {.timeout = std::chrono::seconds(240)});
}
