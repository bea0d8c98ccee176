// DistributedDataParallel against single-process references, over world
// sizes 1..4: equal parameters after K steps, no_sync accumulation, unused
// parameters, buffers, uneven inputs (Join), model mismatch, comm hooks.
#include <gtest/gtest.h>

#include <csignal>

#include <cstdlib>
#include <iostream>

#include "ddp_helpers.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "dtrain/parallel/ddp/join.h"
#include "ranks.h"

using dtrain::DDPOptions;
using dtrain::DistributedDataParallel;
using dtrain::dist::GroupOptions;
using namespace dtrain::testing;

namespace {
constexpr int kSteps = 5;
constexpr int kBatch = 6;
constexpr double kLr = 0.1;

GroupOptions group_options() {
  return GroupOptions{.timeout = std::chrono::seconds(30)};
}

// One process trains on every rank's batch of each step, concatenated.
std::vector<at::Tensor> reference(int world, int steps, const std::function<Mlp()>& make) {
  Mlp model = make();
  torch::optim::SGD opt(model->parameters(), kLr);
  for (int t = 0; t < steps; ++t) {
    const Batch all = global_batch(world, t, kBatch);
    opt.zero_grad();
    loss_of(model->forward(all.x), all.y).backward();
    opt.step();
  }
  return snapshot(*model);
}

Mlp seeded_mlp(int seed, int hidden = 16, bool extra = false, bool norm = false) {
  return seeded(seed, [&] { return Mlp(hidden, extra, norm); });
}

struct Variant {
  const char* name;
  DDPOptions options;
};

const Variant kVariants[] = {
    {"default", {}},
    {"tiny_buckets", {.bucket_cap_mb = 0.0005, .first_bucket_cap_mb = 0.0002}},
    {"bucket_view", {.gradient_as_bucket_view = true}},
    {"static_graph", {.static_graph = true}},
    {"find_unused", {.find_unused_parameters = true}},
};

class DdpSweep : public ::testing::TestWithParam<std::tuple<int, int>> {};
}  // namespace

TEST_P(DdpSweep, EqualsSingleProcessOnConcatenatedBatch) {
  const auto [world, variant_index] = GetParam();
  const Variant& variant = kVariants[variant_index];
  const auto expected = reference(world, kSteps, [] { return seeded_mlp(1); });
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, group_options());
    // Ranks start from different weights: DDP must broadcast rank 0's.
    DistributedDataParallel ddp(seeded_mlp(rank == 0 ? 1 : 100 + rank), group, variant.options);
    torch::optim::SGD opt(ddp.module()->parameters(), kLr);
    for (int t = 0; t < kSteps; ++t) {
      const Batch b = batch_for(rank, t, kBatch);
      ddp.zero_grad(/*set_to_none=*/t % 2 == 0);  // both ways; torch::optim's would break bucket views
      loss_of(ddp(b.x), b.y).backward();
      opt.step();
    }
    EXPECT_TRUE(params_close(snapshot(*ddp.module()), expected)) << variant.name << " rank " << rank;
  });
}

INSTANTIATE_TEST_SUITE_P(WorldsAndOptions, DdpSweep,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Range(0, 5)),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) + "_" +
                                  kVariants[std::get<1>(info.param)].name;
                         });

class DdpProcesses : public ::testing::TestWithParam<bool> {};

// Real processes, with the intra-host shared-memory all-reduce (the default
// on one host) and with Gloo.
TEST_P(DdpProcesses, EqualSingleProcess) {
  const bool shared_memory = GetParam();
  const int world = 3;
  const auto expected = reference(world, kSteps, [] { return seeded_mlp(1); });
  run_rank_processes(world, [&](int rank) {
    auto options = group_options();
    options.intra_host_shared_memory = shared_memory;
    auto group = dtrain::dist::init_process_group(options);
    DistributedDataParallel ddp(seeded_mlp(rank == 0 ? 1 : 55), group, {.bucket_cap_mb = 0.0005});
    torch::optim::SGD opt(ddp.module()->parameters(), kLr);
    for (int t = 0; t < kSteps; ++t) {
      const Batch b = batch_for(rank, t, kBatch);
      opt.zero_grad();
      loss_of(ddp(b.x), b.y).backward();
      opt.step();
    }
    EXPECT_EQ(group.uses_shared_memory(), shared_memory);
    EXPECT_TRUE(params_close(snapshot(*ddp.module()), expected));
    // Every rank holds bitwise the same parameters.
    for (const auto& p : ddp.module()->parameters()) {
      const auto all = group.all_gather(p.detach().contiguous());
      for (const auto& other : all) EXPECT_TRUE(at::equal(other, all.front()));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, DdpProcesses, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "shared_memory" : "gloo"; });

class DdpPeerDeath : public ::testing::TestWithParam<bool> {};

// A peer SIGKILLed before its share of backward's all-reduce: the survivor's
// backward throws a CommunicationError (no hang), over either transport.
TEST_P(DdpPeerDeath, BackwardFailsWithCommunicationErrorInsteadOfHanging) {
  const bool shared_memory = GetParam();
  const auto outcomes =
      run_rank_processes(2,
                         [&](int rank) {
                           auto group = dtrain::dist::init_process_group(
                               {.timeout = std::chrono::seconds(10), .intra_host_shared_memory = shared_memory});
                           DistributedDataParallel ddp(seeded_mlp(1), group);
                           const Batch b = batch_for(rank, 0, kBatch);
                           at::Tensor loss = loss_of(ddp(b.x), b.y);
                           if (rank == 1) std::raise(SIGKILL);  // gone before its share of the all-reduce
                           try {
                             loss.backward();
                             ADD_FAILURE() << "backward completed without its peer";
                           } catch (const dtrain::CommunicationError& e) {
                             std::cerr << "rank 0 error: " << e.what() << std::endl;
                           }
                         },
                         {.expect_success = false});
  // The error names this rank, the operation and the group (and, through
  // shared memory, the peer; Gloo's collectives do not say which peer).
  EXPECT_NE(outcomes[0].output.find("rank 0 error: [rank 0/2] all_reduce(sum) on gloo group 'world'"),
            std::string::npos)
      << outcomes[0].output;
  if (shared_memory) {
    EXPECT_NE(outcomes[0].output.find("peer rank 1 (pid"), std::string::npos) << outcomes[0].output;
  }
  EXPECT_FALSE(outcomes[0].timed_out);
  EXPECT_EQ(outcomes[0].exit_code, 0) << "signal " << outcomes[0].signal;
}

INSTANTIATE_TEST_SUITE_P(Transports, DdpPeerDeath, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "shared_memory" : "gloo"; });

TEST(Ddp, BucketsFollowCapsAfterRebuild) {
  // fc2 (4x64 + 4 floats = 1040 bytes) and fc1 (64x10 + 64 floats = 2816
  // bytes). A bucket closes once it reaches its cap, so a 1 KiB cap gives one
  // bucket per layer, last layer first; 25 MiB gives one bucket.
  for (double cap_mb : {1.0 / 1024, 25.0}) {
    run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, 2, group_options());
      DistributedDataParallel ddp(seeded_mlp(1, 64), group, {.bucket_cap_mb = cap_mb, .first_bucket_cap_mb = cap_mb});
      EXPECT_EQ(ddp.engine().bucket_sizes(), std::vector<std::size_t>{1040 + 2816});  // first iteration: one bucket
      torch::optim::SGD opt(ddp.module()->parameters(), kLr);
      for (int t = 0; t < 2; ++t) {
        const Batch b = batch_for(rank, t, kBatch);
        opt.zero_grad();
        loss_of(ddp(b.x), b.y).backward();
        opt.step();
      }
      const auto expected = cap_mb < 1 ? std::vector<std::size_t>{1040, 2816} : std::vector<std::size_t>{1040 + 2816};
      EXPECT_EQ(ddp.engine().bucket_sizes(), expected) << "cap " << cap_mb << " MiB";
    });
  }
}

TEST(Ddp, NoSyncAccumulationEqualsOneStepOnTheUnion) {
  for (int world : {1, 2, 3}) {
    const int micro = 3;
    // Reference: one step on all ranks' micro-batches together.
    Mlp ref = seeded_mlp(1);
    torch::optim::SGD ref_opt(ref->parameters(), kLr);
    std::vector<Batch> parts;
    for (int r = 0; r < world; ++r) {
      for (int k = 0; k < micro; ++k) parts.push_back(batch_for(r, k, kBatch));
    }
    const Batch all = concat(parts);
    loss_of(ref->forward(all.x), all.y).backward();
    ref_opt.step();
    const auto expected = snapshot(*ref);

    run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, world, group_options());
      DistributedDataParallel ddp(seeded_mlp(1), group);
      torch::optim::SGD opt(ddp.module()->parameters(), kLr);
      opt.zero_grad();
      {
        auto guard = ddp.no_sync();
        for (int k = 0; k < micro - 1; ++k) {
          const Batch b = batch_for(rank, k, kBatch);
          (loss_of(ddp(b.x), b.y) / micro).backward();
        }
      }
      const Batch last = batch_for(rank, micro - 1, kBatch);
      (loss_of(ddp(last.x), last.y) / micro).backward();
      opt.step();
      EXPECT_TRUE(params_close(snapshot(*ddp.module()), expected)) << "world " << world;
    });
  }
}

TEST(Ddp, UnusedParametersWithFindUnused) {
  // The extra head is used only in odd steps, on every rank.
  const int world = 2;
  Mlp ref = seeded_mlp(3, 16, true);
  torch::optim::SGD ref_opt(ref->parameters(), kLr);
  for (int t = 0; t < kSteps; ++t) {
    const Batch all = global_batch(world, t, kBatch);
    ref_opt.zero_grad();
    loss_of(ref->forward(all.x, t % 2 == 1), all.y).backward();
    ref_opt.step();
  }
  const auto expected = snapshot(*ref);
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, group_options());
    DistributedDataParallel ddp(seeded_mlp(3, 16, true), group, {.find_unused_parameters = true});
    torch::optim::SGD opt(ddp.module()->parameters(), kLr);
    for (int t = 0; t < kSteps; ++t) {
      const Batch b = batch_for(rank, t, kBatch);
      opt.zero_grad();
      loss_of(ddp(b.x, t % 2 == 1), b.y).backward();
      opt.step();
    }
    EXPECT_TRUE(params_close(snapshot(*ddp.module()), expected));
  });
}

TEST(Ddp, UnusedParameterWithoutFindUnusedIsAClearError) {
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, group_options());
    DistributedDataParallel ddp(seeded_mlp(3, 16, true), group);
    for (int t = 0; t < 2; ++t) {
      const Batch b = batch_for(rank, t, kBatch);
      try {
        loss_of(ddp(b.x, false), b.y).backward();
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("find_unused_parameters"), std::string::npos) << e.what();
        return;
      }
    }
    ADD_FAILURE() << "no error for a parameter that never gets a gradient";
  });
}

TEST(Ddp, BuffersAreBroadcastFromRankZero) {
  for (bool broadcast : {true, false}) {
    run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, 2, group_options());
      Mlp model = seeded_mlp(5, 16, false, true);
      model->norm->running_mean.fill_(static_cast<float>(rank + 1));
      DistributedDataParallel ddp(model, group, {.broadcast_buffers = broadcast});
      // Construction always starts every rank from rank 0's buffers.
      EXPECT_TRUE(at::allclose(ddp.module()->norm->running_mean, at::ones({16})));
      torch::optim::SGD opt(ddp.module()->parameters(), kLr);
      for (int t = 0; t < 3; ++t) {
        const Batch b = batch_for(rank, t, kBatch);  // different data per rank
        opt.zero_grad();
        loss_of(ddp(b.x), b.y).backward();
        opt.step();
      }
      // One more forward on identical input: with broadcasting, every rank
      // starts it from rank 0's statistics and ends with identical ones.
      const Batch same = batch_for(0, 99, kBatch);
      ddp(same.x);
      auto stats = group.all_gather(ddp.module()->norm->running_mean.detach().clone());
      EXPECT_EQ(at::equal(stats[0], stats[1]), broadcast);
    });
  }
}

TEST(Ddp, ModelThatDiffersAcrossRanksFailsOnEveryRank) {
  run_rank_threads(3, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 3, group_options());
    try {
      DistributedDataParallel ddp(seeded_mlp(1, rank == 2 ? 8 : 16), group);
      ADD_FAILURE() << "no error on rank " << rank;
    } catch (const dtrain::ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the model differs across ranks: parameter 'fc1.weight' Float [16, 10] on rank 0 but "
                          "parameter 'fc1.weight' Float [8, 10] on rank 2"),
                std::string::npos)
          << what;
    }
  });
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, group_options());
    try {
      DistributedDataParallel ddp(seeded_mlp(1, 16, rank == 1), group);
      ADD_FAILURE() << "no error on rank " << rank;
    } catch (const dtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 has 4 parameters and buffers, rank 1 has 6"), std::string::npos)
          << e.what();
    }
  });
}

TEST(Ddp, UnevenInputsWithJoin) {
  // Rank r has 2 + r batches. Joined ranks contribute zero gradients and the
  // sum is divided by the world size (torch's default).
  for (int world : {2, 3}) {
    auto batches_of = [](int rank) { return 2 + rank; };
    Mlp ref = seeded_mlp(9);
    torch::optim::SGD ref_opt(ref->parameters(), kLr);
    for (int t = 0; t < batches_of(world - 1); ++t) {
      ref_opt.zero_grad();
      at::Tensor loss = at::zeros({});
      for (int r = 0; r < world; ++r) {
        if (t < batches_of(r)) {
          const Batch b = batch_for(r, t, kBatch);
          loss = loss + loss_of(ref->forward(b.x), b.y);
        }
      }
      (loss / world).backward();
      ref_opt.step();
    }
    const auto expected = snapshot(*ref);
    run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, world, group_options());
      DistributedDataParallel ddp(seeded_mlp(9), group);
      torch::optim::SGD opt(ddp.module()->parameters(), kLr);
      dtrain::Join join({&ddp.joinable()});
      for (int t = 0; t < batches_of(rank); ++t) {
        const Batch b = batch_for(rank, t, kBatch);
        opt.zero_grad();
        loss_of(ddp(b.x), b.y).backward();
        opt.step();
      }
      join.finish();
      EXPECT_TRUE(params_close(snapshot(*ddp.module()), expected)) << "world " << world << " rank " << rank;
    });
  }
}

TEST(Ddp, JoinCanThrowOnEarlyTermination) {
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, group_options());
    DistributedDataParallel ddp(seeded_mlp(9), group);
    dtrain::Join join({&ddp.joinable()}, {.throw_on_early_termination = true});
    EXPECT_THROW(
        {
          for (int t = 0; t < 2 + 3 * rank; ++t) {
            const Batch b = batch_for(rank, t, kBatch);
            loss_of(ddp(b.x), b.y).backward();
          }
          join.finish();
        },
        dtrain::CommunicationError);
  });
}

TEST(Ddp, SwappedParameterStorageIsAClearError) {
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, group_options());
    DistributedDataParallel ddp(seeded_mlp(1), group);
    {
      torch::NoGradGuard no_grad;
      ddp.module()->fc1->weight.set_(at::zeros_like(ddp.module()->fc1->weight));  // what Module::load does
    }
    const Batch b = batch_for(rank, 0, kBatch);
    try {
      ddp(b.x);
      ADD_FAILURE() << "no error";
    } catch (const dtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("parameter 'fc1.weight' got new storage"), std::string::npos) << e.what();
    }
  });
}

TEST(Ddp, BadOptionsAreRejected) {
  run_rank_threads(1, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 1, group_options());
    EXPECT_THROW(DistributedDataParallel(seeded_mlp(1), group, {.bucket_cap_mb = 0}), dtrain::ConfigError);
    DistributedDataParallel ddp(seeded_mlp(1), group);
    const Batch b = batch_for(0, 0, kBatch);
    loss_of(ddp(b.x), b.y).backward();
    EXPECT_THROW(ddp.register_comm_hook(dtrain::hooks::fp16_compress()), dtrain::ConfigError);
    EXPECT_THROW(dtrain::hooks::powersgd({.start_iteration = 0}), dtrain::ConfigError);
  });
}
