// AMP, accumulation and clipping across ranks (rank threads):
//   - GradScaler under DDP, 2 ranks, an inf on rank 1 only: both ranks skip
//     that step, back off alike and stay identical; with a per-rank inf after
//     the reduction (as sharded strategies have), found_inf_group makes them
//     agree, and without it they would diverge;
//   - accumulate_gradients over k micro-batches with DDP on 1..3 ranks equals
//     one step on the union (fp32, rtol 1e-5), with and without a GradScaler;
//   - clipping by global norm over gradients sharded across 2 and 3 ranks
//     equals single-process clipping.
#include <gtest/gtest.h>

#include <limits>
#include <ostream>

#include "ddp_helpers.h"
#include "dtrain/amp/grad_scaler.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/error.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "dtrain/trainer/accumulate.h"
#include "ranks.h"

using dtrain::DistributedDataParallel;
using dtrain::amp::GradScaler;
using dtrain::dist::GroupOptions;
using dtrain::dist::ProcessGroup;
using namespace dtrain::testing;

namespace {
constexpr double kAmpLr = 0.1;
constexpr int kAmpBatch = 4;

GroupOptions amp_group_options() {
  return GroupOptions{.timeout = std::chrono::seconds(30)};
}

Mlp amp_mlp(int seed) {
  return seeded(seed, [] { return Mlp(16); });
}

at::Tensor flat_params(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape(-1));
  return at::cat(parts);
}

// Whether `t` is bitwise the same on every rank of `group`.
bool same_on_all_ranks(ProcessGroup& group, const at::Tensor& t) {
  const auto all = group.all_gather(t.contiguous());
  for (const auto& other : all) {
    if (!at::equal(other, all.front())) return false;
  }
  return true;
}
}  // namespace

// Rank 1's input holds an inf at step 2: the loss and, through DDP's
// all-reduce, every rank's gradients become non-finite, so both skip.
TEST(AmpDdp, InfOnOneRankSkipsTheStepOnBothRanks) {
  constexpr int kWorld = 2, kSteps = 5, kBadStep = 2;
  run_rank_threads(kWorld, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, kWorld, amp_group_options());
    DistributedDataParallel ddp(amp_mlp(1), group);
    torch::optim::SGD opt(ddp.module()->parameters(), kAmpLr);
    GradScaler scaler({.init_scale = 1024.0, .growth_interval = 2});
    for (int t = 0; t < kSteps; ++t) {
      Batch b = batch_for(rank, t, kAmpBatch);
      if (t == kBadStep && rank == 1) b.x[0][3] = std::numeric_limits<float>::infinity();
      ddp.zero_grad();
      const at::Tensor before = flat_params(*ddp.module());
      scaler.scale(loss_of(ddp(b.x), b.y)).backward();
      const bool stepped = scaler.step(opt);
      scaler.update();
      EXPECT_EQ(stepped, t != kBadStep) << "rank " << rank << " step " << t;
      EXPECT_EQ(at::equal(before, flat_params(*ddp.module())), t == kBadStep);
      EXPECT_TRUE(same_on_all_ranks(group, flat_params(*ddp.module()))) << "step " << t;
    }
    // 1024 -> 2048 (2 clean) -> 1024 (skip) -> 2048 (2 clean).
    EXPECT_EQ(scaler.get_scale(), 2048.0);
  });
}

// Gradients that differ per rank after the reduction (here an inf planted on
// rank 1 only, as a ZeRO shard or pipeline stage would have): found_inf_group
// makes both ranks skip; without it rank 0 would step alone.
TEST(AmpDdp, FoundInfGroupMakesRanksAgreeWhenGradientsDiffer) {
  constexpr int kWorld = 2;
  for (const bool reduce : {true, false}) {
    run_rank_threads(kWorld, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, kWorld, amp_group_options());
      DistributedDataParallel ddp(amp_mlp(1), group);
      torch::optim::SGD opt(ddp.module()->parameters(), kAmpLr);
      dtrain::amp::GradScalerOptions options;
      if (reduce) options.found_inf_group = group;
      GradScaler scaler(options);
      const Batch b = batch_for(rank, 0, kAmpBatch);
      ddp.zero_grad();
      scaler.scale(loss_of(ddp(b.x), b.y)).backward();
      if (rank == 1) ddp.module()->fc2->bias.mutable_grad()[1] = std::numeric_limits<float>::quiet_NaN();
      const bool stepped = scaler.step(opt);
      scaler.update();
      if (reduce) {
        EXPECT_FALSE(stepped) << "rank " << rank;
        EXPECT_EQ(scaler.get_scale(), 32768.0);
        EXPECT_TRUE(same_on_all_ranks(group, flat_params(*ddp.module())));
      } else {
        EXPECT_EQ(stepped, rank == 0);  // the divergence the reduction prevents
        EXPECT_FALSE(same_on_all_ranks(group, flat_params(*ddp.module())));
      }
    });
  }
}

namespace {
struct AccumulationCase {
  int world;
  bool with_scaler;
};

void PrintTo(const AccumulationCase& c, std::ostream* os) {
  *os << "world " << c.world << (c.with_scaler ? " with GradScaler" : " fp32");
}

class Accumulation : public ::testing::TestWithParam<AccumulationCase> {};

constexpr int kMicro = 3, kMicroBatch = 4, kOptSteps = 2;

// Micro-batch i of rank r at optimizer step t.
Batch micro_batch(int rank, int t, int i) {
  return batch_for(rank, 100 * t + i, kMicroBatch);
}
}  // namespace

TEST_P(Accumulation, EqualsOneStepOnTheUnion) {
  const auto [world, with_scaler] = GetParam();
  // Reference: one process, one step per optimizer step on every rank's every micro-batch.
  Mlp reference = amp_mlp(1);
  {
    torch::optim::SGD opt(reference->parameters(), kAmpLr);
    for (int t = 0; t < kOptSteps; ++t) {
      std::vector<Batch> parts;
      for (int r = 0; r < world; ++r) {
        for (int i = 0; i < kMicro; ++i) parts.push_back(micro_batch(r, t, i));
      }
      const Batch all = concat(parts);
      opt.zero_grad();
      loss_of(reference->forward(all.x), all.y).backward();
      opt.step();
    }
  }
  const auto expected = snapshot(*reference);
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, amp_group_options());
    DistributedDataParallel ddp(amp_mlp(1), group);
    torch::optim::SGD opt(ddp.module()->parameters(), kAmpLr);
    GradScaler scaler({.enabled = with_scaler});
    for (int t = 0; t < kOptSteps; ++t) {
      ddp.zero_grad();
      dtrain::accumulate_gradients(ddp, kMicro, [&](int i) {
        const Batch b = micro_batch(rank, t, i);
        scaler.scale(loss_of(ddp(b.x), b.y) / kMicro).backward();
        if (world > 1 && i == 0) {
          // Under no_sync nothing was exchanged: each rank has its own gradients.
          EXPECT_FALSE(same_on_all_ranks(group, ddp.module()->fc1->weight.grad()));
        }
      });
      EXPECT_TRUE(same_on_all_ranks(group, ddp.module()->fc1->weight.grad()));
      EXPECT_TRUE(scaler.step(opt));
      scaler.update();
    }
    EXPECT_TRUE(params_close(snapshot(*ddp.module()), expected, 1e-5)) << "rank " << rank;
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Accumulation,
                         ::testing::Values(AccumulationCase{1, false}, AccumulationCase{2, false},
                                           AccumulationCase{3, false}, AccumulationCase{2, true},
                                           AccumulationCase{3, true}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) +
                                  (info.param.with_scaler ? "_scaler" : "_fp32");
                         });

// A model without no_sync (a plain module) just runs the micro-steps.
TEST(Accumulation, PlainModuleEqualsOneBigBatch) {
  Mlp big = amp_mlp(1), accumulated = amp_mlp(1);
  std::vector<Batch> parts;
  for (int i = 0; i < kMicro; ++i) parts.push_back(micro_batch(0, 0, i));
  const Batch all = concat(parts);
  loss_of(big->forward(all.x), all.y).backward();
  int calls = 0;
  dtrain::accumulate_gradients(accumulated, kMicro, [&](int i) {
    ++calls;
    loss_of(accumulated->forward(parts[static_cast<size_t>(i)].x), parts[static_cast<size_t>(i)].y)
        .div(kMicro)
        .backward();
  });
  EXPECT_EQ(calls, kMicro);
  EXPECT_TRUE(at::allclose(accumulated->fc1->weight.grad(), big->fc1->weight.grad(), 1e-5, 1e-7));
  EXPECT_THROW(dtrain::accumulate_gradients(accumulated, 0, [](int) {}), dtrain::ConfigError);
}

// Gradients sharded across ranks (parameter j on rank j % world): the global
// norm and the clipped gradients equal single-process clipping of them all.
TEST(ShardedClip, EqualsSingleProcessClipping) {
  constexpr int kParams = 7;
  auto make = [] {
    auto g = at::make_generator<at::CPUGeneratorImpl>(5);
    std::vector<at::Tensor> params;
    for (int j = 0; j < kParams; ++j) {
      at::Tensor p = at::randn({j + 1, 3}, g).requires_grad_();
      p.mutable_grad() = at::randn({j + 1, 3}, g);
      params.push_back(p);
    }
    return params;
  };
  for (const double p : {2.0, std::numeric_limits<double>::infinity()}) {
    auto single = make();
    const double expected = dtrain::clip_grad_norm_(single, 0.5, {.norm_type = p}).item<double>();
    for (const int world : {2, 3}) {
      run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
        auto group = dtrain::dist::init_process_group(store, rank, world, amp_group_options());
        auto all = make();
        std::vector<at::Tensor> mine;
        for (int j = rank; j < kParams; j += world) mine.push_back(all[static_cast<size_t>(j)]);
        const auto shards = dtrain::GradientSet::sharded(mine, group);
        const double norm = dtrain::clip_grad_norm_(shards, 0.5, {.norm_type = p}).item<double>();
        EXPECT_NEAR(norm, expected, 1e-6 * expected) << "p=" << p << " world " << world;
        for (int j = rank; j < kParams; j += world) {
          const auto idx = static_cast<size_t>(j);
          EXPECT_TRUE(at::allclose(all[idx].grad(), single[idx].grad(), 1e-6, 1e-7)) << "param " << j;
        }
      });
    }
  }
}
