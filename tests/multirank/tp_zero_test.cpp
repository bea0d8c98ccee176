// Tensor parallelism inside ZeRO's sharding groups: tp 2 x dp_shard 2 on 4
// processes, ZeRO 1, 2 and 3 over dp_shard (ZeroOptions::mesh) of a model of
// dtrain::nn tensor-parallel layers with odd sizes (units padded, shards
// uneven): three AdamW steps with global-norm clipping (acting at the first
// step) equal one process training the unsplit model on the union batch:
// losses, norms and every rank's part of every parameter (rtol 1e-5). The
// gradient norm combines over dp_shard and tp from the layouts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <iostream>
#include <sstream>

#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "ranks.h"
#include "tp_compose_model.h"

using namespace dtrain::testing::tp_compose;

TEST(TpCompose, TensorParallelTimesZeroEqualsOneProcess) {
  constexpr int kSteps = 3, kBatch = 10;
  constexpr double kMaxNorm = 0.1, kLr = 0.02;
  dtrain::testing::run_rank_processes(
      4,
      [&](int rank) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(60)});
        dtrain::dist::DeviceMesh mesh(world, {{"dp_shard", 2}, {"tp", 2}});
        std::ostringstream failures;
        int compared = 0;
        for (int stage = 1; stage <= 3; ++stage) {
          const std::string where = "zero" + std::to_string(stage) + " rank " + std::to_string(rank);
          torch::nn::Sequential net = tp_net(mesh);
          dtrain::ShardedDataParallel sdp(net, mesh["dp_shard"], {.stage = stage, .mesh = mesh});
          torch::optim::AdamW opt(sdp.parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.1));
          torch::nn::Sequential reference = reference_net();
          torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.1));
          const int dp = mesh.coordinate("dp_shard");
          for (int step = 0; step < kSteps; ++step) {
            const ComposeBatch b = compose_batch(kBatch, step);
            const auto half = [&](const at::Tensor& t) { return t.chunk(2, 0)[dp]; };
            sdp.zero_grad();
            const at::Tensor loss = compose_loss(sdp.forward(half(b.x)), half(b.y));
            loss.backward();
            const at::Tensor norm = dtrain::clip_grad_norm_(sdp.gradients(), kMaxNorm);
            opt.step();
            ref_opt.zero_grad();
            const at::Tensor ref_loss = compose_loss(reference->forward(b.x), b.y);
            ref_loss.backward();
            const at::Tensor ref_norm = dtrain::clip_grad_norm_(reference->parameters(), kMaxNorm);
            ref_opt.step();
            if (step == 0 && ref_norm.item<double>() <= kMaxNorm) failures << where << ": clipping did not act\n";
            compose_close(norm, ref_norm, where + " norm at step " + std::to_string(step), failures);
            at::Tensor both = loss.detach().reshape({1}).clone();
            mesh["dp_shard"].all_reduce(both, dtrain::dist::ReduceOp::kAvg).wait();
            compose_close(both.reshape({}), ref_loss.detach(), where + " loss at step " + std::to_string(step),
                          failures);
          }
          dtrain::ShardedDataParallel::FullParameters full(sdp);
          compared += compare_parts(*net, mesh, reference, where, failures);
        }
        EXPECT_EQ(compared, 3 * 18);
        EXPECT_TRUE(failures.str().empty()) << failures.str();
        if (!failures.str().empty()) std::cerr << failures.str();
      },
      {.timeout = std::chrono::seconds(120)});
}

// The norm's groups: dp_shard (the shards) and tp (the tp-sharded
// parameters); each tp-replicated piece counted on tp rank 0 only.
TEST(TpCompose, ZeroNormCombinesOverDpShardAndTp) {
  dtrain::testing::run_rank_threads(4, [&](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, 4, {.timeout = std::chrono::seconds(60)});
    dtrain::dist::DeviceMesh mesh(world, {{"dp_shard", 2}, {"tp", 2}});
    torch::nn::Sequential net = tp_net(mesh);
    dtrain::ShardedDataParallel sdp(net, mesh["dp_shard"], {.stage = 2, .mesh = mesh});
    const dtrain::GradientSet& set = sdp.gradients();
    ASSERT_EQ(set.combine_over.size(), 2u);
    EXPECT_EQ(set.combine_over[0].size(), 2);
    std::size_t replicated_pieces = 0;
    for (const dtrain::ParameterShard& piece : sdp.parameter_shards()) {
      if (piece.name.find(".ln.") != std::string::npos || piece.name.rfind("3.", 0) == 0 ||
          piece.name.find("row.bias") != std::string::npos)
        ++replicated_pieces;
    }
    const std::size_t counted = set.parameters.size();
    const std::size_t all = sdp.parameter_shards().size();
    EXPECT_EQ(counted, mesh.coordinate("tp") == 0 ? all : all - replicated_pieces);
    EXPECT_GT(replicated_pieces, 0u);
  });
}
