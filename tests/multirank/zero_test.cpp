// ShardedDataParallel (ZeRO stages 1-3) against a single process training on
// the full batch (what DDP computes), over worlds 1..4 and as HSDP on a
// dp_replicate x dp_shard mesh; stage 3's memory; a peer dying mid-collective.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <torch/serialize/archive.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <iostream>
#include <mutex>

#include "dtrain/amp/grad_scaler.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "dtrain/parallel/zero/sharded_checkpoint.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "ranks.h"
#include "zero_helpers.h"

namespace {

using dtrain::testing::run_rank_processes;
using dtrain::testing::run_rank_threads;
using namespace dtrain::testing::zero;

// Every stage with SGD (momentum, weight decay) and AdamW equals the
// full-batch reference after several steps, on every world size.
class ZeroMatchesReference : public ::testing::TestWithParam<int> {};

TEST_P(ZeroMatchesReference, AllStagesSgdAndAdamW) {
  const int world = GetParam();
  constexpr int kSteps = 4, kPerRank = 6;
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
    for (int stage = 1; stage <= 3; ++stage) {
      for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdamW}) {
        SCOPED_TRACE("stage " + std::to_string(stage) + " " + to_string(kind));
        auto model = make_model();
        auto reference = make_model();
        dtrain::ShardedDataParallel sdp(model, group, {.stage = stage});
        auto opt = make_optimizer(kind, sdp.parameters());
        auto ref_opt = make_optimizer(kind, trainable(*reference));
        for (int step = 0; step < kSteps; ++step) {
          const Batch batch = global_batch(step, world * kPerRank);
          const Batch mine = batch.slice(rank * kPerRank, kPerRank);
          opt->zero_grad();
          loss_of(sdp(mine.x), mine.y).backward();
          opt->step();
          ref_opt->zero_grad();
          loss_of(reference->forward(batch.x), batch.y).backward();
          ref_opt->step();
        }
        expect_equal_parameters(sdp.full_state_dict(), *reference);
        if (stage < 3) {  // the module's own parameters are the full ones after the next pre_forward
          sdp.pre_forward();
          expect_equal_parameters(named(*model), *reference);
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, ZeroMatchesReference, ::testing::Values(1, 2, 3, 4));

// Accumulation under no_sync, a later synchronising backward, and stage 3
// without resharding after forward, against the reference.
TEST(Zero, NoSyncAccumulationAndNoReshardAfterForward) {
  constexpr int world = 3, kPerRank = 4;
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
    for (int stage = 1; stage <= 3; ++stage) {
      for (const bool reshard : {true, false}) {
        if (stage < 3 && !reshard) continue;
        SCOPED_TRACE("stage " + std::to_string(stage) + (reshard ? "" : " no reshard"));
        auto model = make_model();
        auto reference = make_model();
        dtrain::ShardedDataParallel sdp(model, group, {.stage = stage, .reshard_after_forward = reshard});
        auto opt = make_optimizer(OptimizerKind::kAdamW, sdp.parameters());
        auto ref_opt = make_optimizer(OptimizerKind::kAdamW, trainable(*reference));
        for (int step = 0; step < 3; ++step) {
          opt->zero_grad();
          ref_opt->zero_grad();
          for (int micro = 0; micro < 2; ++micro) {
            const Batch batch = global_batch(10 * step + micro, world * kPerRank);
            const Batch mine = batch.slice(rank * kPerRank, kPerRank);
            if (micro == 0) {
              auto guard = sdp.no_sync();
              (loss_of(sdp(mine.x), mine.y) / 2).backward();
            } else {
              (loss_of(sdp(mine.x), mine.y) / 2).backward();
            }
            (loss_of(reference->forward(batch.x), batch.y) / 2).backward();
          }
          opt->step();
          ref_opt->step();
        }
        expect_equal_parameters(sdp.full_state_dict(), *reference);
      }
    }
  });
}

// The flat buffers (gathered units, gradients, reductions) live on the
// parameters' device, so a module spread over two devices is refused, naming
// a parameter (the GPU tests cover ZeRO-3 on CUDA).
TEST(Zero, ParametersOnTwoDevicesAreRefused) {
  run_rank_threads(1, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 1, {.timeout = std::chrono::seconds(30)});
    auto model = make_model();  // on the CPU, plus one parameter on the meta device
    model->register_parameter("on_meta", at::ones({4}, at::TensorOptions().device(at::kMeta)));
    try {
      dtrain::ShardedDataParallel sdp(model, group, {.stage = 3});
      ADD_FAILURE() << "a module on the CPU and the meta device was accepted";
    } catch (const dtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("every parameter on one device"), std::string::npos) << e.what();
    }
  });
}

// Stage 3 holds at most the two largest units beside its shard of the model.
TEST(Zero, Stage3PeakParameterMemoryIsTwoUnitsPlusShard) {
  constexpr int world = 2;
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
    torch::nn::Sequential model = seeded_sequential({48, 96, 96, 160, 96, 64, 10});
    std::vector<std::int64_t> unit_bytes;
    std::int64_t total = 0;
    for (const auto& child : model->children()) {
      std::int64_t n = 0;
      for (const auto& p : child->parameters()) n += p.numel();
      unit_bytes.push_back(((n + world - 1) / world) * world * 4);
      total += ((n + world - 1) / world) * 4;  // this rank's chunk of the unit
    }
    std::sort(unit_bytes.rbegin(), unit_bytes.rend());
    const std::int64_t bound = unit_bytes[0] + unit_bytes[1] + total;

    dtrain::ShardedDataParallel sdp(model, group, {.stage = 3});
    EXPECT_EQ(sdp.memory_stats().parameter_bytes, total) << "stage 3 keeps only its shards between steps";
    torch::optim::SGD opt(sdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 2; ++step) {
      sdp.reset_peak();
      const Batch batch = global_batch(step, 8, 48, 10);
      opt.zero_grad();
      loss_of(sdp(batch.x), batch.y).backward();
      opt.step();
      const auto stats = sdp.memory_stats();
      EXPECT_EQ(stats.parameter_bytes, total);
      EXPECT_LE(stats.peak_parameter_bytes, bound * 11 / 10) << "rank " << rank;
      EXPECT_GT(stats.peak_parameter_bytes, total + unit_bytes.back()) << "gathers are counted";
    }
  });
}

// A rank dying while the others all-gather (stage 3 forward) or
// reduce-scatter (stage 2 backward): CommunicationError, no hang.
// (One run_rank_processes per test: a rank process re-runs the test body.)
class ZeroPeerDeath : public ::testing::TestWithParam<int> {};

TEST_P(ZeroPeerDeath, SurvivorGetsCommunicationError) {
  const int stage = GetParam();
  {
    const auto outcomes =
        run_rank_processes(2,
                           [&](int rank) {
                             auto group = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(15)});
                             auto model = make_model();
                             dtrain::ShardedDataParallel sdp(model, group, {.stage = stage});
                             torch::optim::SGD opt(sdp.parameters(), 0.1);
                             const Batch batch = global_batch(0, 4).slice(rank * 2, 2);
                             loss_of(sdp(batch.x), batch.y).backward();  // one good step: transports set up
                             opt.step();
                             opt.zero_grad();
                             if (stage == 3 && rank == 1) std::raise(SIGKILL);
                             try {
                               at::Tensor loss = loss_of(sdp(batch.x), batch.y);
                               group.barrier();  // every gather done: rank 0 fails in the reduce-scatter
                               if (rank == 1) std::raise(SIGKILL);
                               loss.backward();
                               ADD_FAILURE() << "a step completed without its peer";
                             } catch (const dtrain::CommunicationError& e) {
                               std::cerr << "survivor: " << e.what() << std::endl;
                             }
                           },
                           {.timeout = std::chrono::seconds(60), .expect_success = false});
    const std::string& out = outcomes[0].output;
    EXPECT_FALSE(outcomes[0].timed_out) << out;
    EXPECT_NE(out.find("survivor: [rank 0/2]"), std::string::npos) << out;
    EXPECT_NE(out.find(stage == 3 ? "all_gather" : "reduce_scatter"), std::string::npos) << out;
  }
}

// Stage 3 dies in the forward's all-gather, stage 2 in the backward's reduce-scatter.
INSTANTIATE_TEST_SUITE_P(Stages, ZeroPeerDeath, ::testing::Values(2, 3));

}  // namespace

namespace {

// Mixed precision: fp64 compute over fp32 masters tracks the fp32 reference
// closely; bf16 compute with fp32 or bf16 reduction stays near it.
TEST(Zero, MixedPrecisionPolicy) {
  constexpr int world = 2, kPerRank = 4;
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
    struct Case {
      int stage;
      c10::ScalarType param, reduce;
      double rtol;
    };
    for (const Case c : {Case{2, at::kDouble, at::kDouble, 1e-4}, Case{3, at::kDouble, at::kFloat, 1e-4},
                         Case{1, at::kBFloat16, at::kFloat, 5e-2}, Case{3, at::kBFloat16, at::kFloat, 5e-2},
                         Case{1, at::kBFloat16, at::kBFloat16, 5e-2}, Case{2, at::kBFloat16, at::kBFloat16, 5e-2}}) {
      SCOPED_TRACE("stage " + std::to_string(c.stage) + " " + c10::toString(c.param));
      auto model = make_model();
      auto reference = make_model();
      dtrain::ShardedDataParallel sdp(
          model, group, {.stage = c.stage, .mixed_precision = {.param_dtype = c.param, .reduce_dtype = c.reduce}});
      for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), c.param);
      for (const auto& s : sdp.parameters()) EXPECT_EQ(s.scalar_type(), at::kFloat) << "fp32 masters";
      auto opt = make_optimizer(OptimizerKind::kAdamW, sdp.parameters());
      auto ref_opt = make_optimizer(OptimizerKind::kAdamW, trainable(*reference));
      for (int step = 0; step < 3; ++step) {
        const Batch batch = global_batch(step, world * kPerRank);
        const Batch mine = batch.slice(rank * kPerRank, kPerRank);
        opt->zero_grad();
        loss_of(sdp(mine.x.to(c.param)).to(at::kFloat), mine.y).backward();
        for (const auto& s : sdp.parameters()) {  // 16-bit reductions stay 16-bit (ZeRO's mixed-precision memory)
          if (s.grad().defined()) {
            EXPECT_EQ(s.grad().scalar_type(), c.reduce == at::kBFloat16 ? c.reduce : at::kFloat);
          }
        }
        opt->step();
        ref_opt->zero_grad();
        loss_of(reference->forward(batch.x), batch.y).backward();
        ref_opt->step();
      }
      expect_equal_parameters(sdp.full_state_dict(), *reference, c.rtol, c.rtol);
    }
  });
}

// GradScaler (found-inf over the group) and clipping by the global norm over
// the shards equal the reference's scaler and clipping.
TEST(Zero, GradScalerAndGlobalNormClipping) {
  constexpr int world = 3, kPerRank = 4;
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
    for (int stage = 1; stage <= 3; ++stage) {
      SCOPED_TRACE("stage " + std::to_string(stage));
      auto model = make_model();
      auto reference = make_model();
      dtrain::ShardedDataParallel sdp(model, group, {.stage = stage});
      auto opt = make_optimizer(OptimizerKind::kSgd, sdp.parameters());
      auto ref_opt = make_optimizer(OptimizerKind::kSgd, trainable(*reference));
      dtrain::amp::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 2, .found_inf_group = group});
      dtrain::amp::GradScaler ref_scaler({.init_scale = 1024.0, .growth_interval = 2});
      for (int step = 0; step < 4; ++step) {
        const Batch batch = global_batch(step, world * kPerRank);
        const Batch mine = batch.slice(rank * kPerRank, kPerRank);
        opt->zero_grad();
        scaler.scale(loss_of(sdp(mine.x), mine.y)).backward();
        scaler.unscale_(*opt);
        const double norm = dtrain::clip_grad_norm_(sdp.gradients(), 0.05).item<double>();
        scaler.step(*opt);
        scaler.update();
        ref_opt->zero_grad();
        ref_scaler.scale(loss_of(reference->forward(batch.x), batch.y)).backward();
        ref_scaler.unscale_(*ref_opt);
        const double ref_norm = dtrain::clip_grad_norm_(trainable(*reference), 0.05).item<double>();
        ref_scaler.step(*ref_opt);
        ref_scaler.update();
        EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm);
      }
      EXPECT_EQ(scaler.get_scale(), ref_scaler.get_scale());
      expect_equal_parameters(sdp.full_state_dict(), *reference);
    }
  });
}

// HSDP on 4 ranks, dp_replicate 2 x dp_shard 2: every stage, SGD and AdamW,
// with global-norm clipping, equals
// one process on the union batch; replicas hold equal shards; a sharded
// checkpoint of it is refused by name.
TEST(Zero, HsdpReplicasOfShardGroupsEqualSingleProcess) {
  constexpr int world = 4, kPerRank = 3, kSteps = 3;
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
    dtrain::dist::DeviceMesh mesh(group, {{"dp_replicate", 2}, {"dp_shard", 2}});
    const int data_rank = mesh.join({"dp_replicate", "dp_shard"}).rank();
    for (int stage = 1; stage <= 3; ++stage) {
      for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdamW}) {
        SCOPED_TRACE("stage " + std::to_string(stage) + " " + to_string(kind) + " rank " + std::to_string(rank));
        auto model = make_model();
        auto reference = make_model();
        dtrain::ShardedDataParallel sdp(model, mesh["dp_shard"],
                                        {.stage = stage, .replicate_group = mesh["dp_replicate"]});
        auto opt = make_optimizer(kind, sdp.parameters());
        auto ref_opt = make_optimizer(kind, trainable(*reference));
        for (int step = 0; step < kSteps; ++step) {
          const Batch batch = global_batch(step, world * kPerRank);
          const Batch mine = batch.slice(data_rank * kPerRank, kPerRank);
          opt->zero_grad();
          loss_of(sdp(mine.x), mine.y).backward();
          const double norm = dtrain::clip_grad_norm_(sdp.gradients(), 0.05).item<double>();
          opt->step();
          ref_opt->zero_grad();
          loss_of(reference->forward(batch.x), batch.y).backward();
          const double ref_norm = dtrain::clip_grad_norm_(trainable(*reference), 0.05).item<double>();
          ref_opt->step();
          EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm);
        }
        expect_equal_parameters(sdp.full_state_dict(), *reference);
        // The two replicas' shards are the same numbers.
        for (const auto& s : sdp.parameter_shards()) {
          at::Tensor other = s.shard.detach().clone();
          mesh["dp_replicate"].broadcast(other, 0).wait();
          EXPECT_TRUE(other.equal(s.shard.detach())) << s.name;
        }
        EXPECT_THROW(dtrain::ShardedCheckpointer({.dir = "/nonexistent"}, sdp, *opt), dtrain::ConfigError);
      }
    }
  });
}

}  // namespace

namespace {

// Save on 4 ranks, load on 2 and on 3: training goes on as an uninterrupted
// run on the same global batches; the consolidated export is the full model.
TEST(Zero, CheckpointSavedOn4ResumesOn2And3) {
  constexpr int kGlobal = 12, kSaveAt = 3, kSteps = 6;
  for (const int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const auto dir = std::filesystem::temp_directory_path() /
                     ("dtrain_zero_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(stage));
    std::filesystem::remove_all(dir);
    auto reference = make_model();
    auto ref_opt = make_optimizer(OptimizerKind::kAdamW, trainable(*reference));
    for (int step = 0; step < kSteps; ++step) {
      const Batch batch = global_batch(step, kGlobal);
      ref_opt->zero_grad();
      loss_of(reference->forward(batch.x), batch.y).backward();
      ref_opt->step();
    }
    auto train = [&](int world, int first, int last, bool save) {
      run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
        auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
        auto model = make_model();
        dtrain::ShardedDataParallel sdp(model, group, {.stage = stage});
        auto opt = make_optimizer(OptimizerKind::kAdamW, sdp.parameters());
        dtrain::ShardedCheckpointer ckpt({.dir = dir}, sdp, *opt);
        if (first > 0) {
          const auto info = ckpt.load_latest();
          ASSERT_TRUE(info.has_value());
          EXPECT_EQ(info->step, first);
          EXPECT_EQ(info->saved_world_size, 4);
          EXPECT_EQ(info->extra, R"({"sampler": 3})");
        }
        const std::int64_t per_rank = kGlobal / world;
        for (int step = first; step < last; ++step) {
          const Batch mine = global_batch(step, kGlobal).slice(rank * per_rank, per_rank);
          opt->zero_grad();
          loss_of(sdp(mine.x), mine.y).backward();
          opt->step();
        }
        if (save) ckpt.save(last, R"({"sampler": 3})");
        if (last == kSteps) {
          expect_equal_parameters(sdp.full_state_dict(), *reference);
          const auto exported = dir / ("full_" + std::to_string(world) + ".pt");
          ckpt.export_full_state_dict(exported);
          torch::serialize::InputArchive archive;
          archive.load_from(exported.string());
          std::map<std::string, at::Tensor> loaded;
          for (const auto& key : archive.keys()) archive.read(key, loaded[key]);
          expect_equal_parameters(loaded, *reference);
        }
      });
    };
    train(4, 0, kSaveAt, /*save=*/true);
    train(2, kSaveAt, kSteps, false);
    train(3, kSaveAt, kSteps, false);
    std::filesystem::remove_all(dir);
  }
}

}  // namespace
