// The Trainer's memory pre-flight (TrainerOptions::memory_check) on 2
// processes: with rank 1's limit under the plan's predicted peak and rank 0's
// far above it, both ranks refuse before any step (neither waits for the
// other in a collective: the test's timeout), each with the planner's
// figure, rank 0 naming rank 1's limit; turned off, the same run trains; with
// room on both, it trains and check_memory's estimate is the planner's.
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>

#include "appliers_model.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "dtrain/plan/device_table.h"
#include "dtrain/trainer/memory_check.h"
#include "dtrain/trainer/parallelize.h"
#include "dtrain/trainer/trainer.h"
#include "ranks.h"

namespace {

constexpr std::int64_t kMemcheckBatch = 12;  // the union batch of every step
constexpr std::int64_t kMemcheckSteps = 2;

const dtrain::ParallelPlan kMemcheckPlan{.dp_replicate = 2, .precision = "fp32", .global_batch = kMemcheckBatch};

// What the check costs (any model the planner knows: the decision is under test).
dtrain::MemoryCheck memcheck_for(const std::string& limit) {
  return {.plan = kMemcheckPlan,
          .model = dtrain::plan::ModelSpec::parse("gpt:layers=2,hidden=32,heads=2,seq=16,vocab=65"),
          .limit = limit,
          .local_ranks = 2};
}

// Trains the appliers' model under DDP with `check`; returns the steps taken.
std::int64_t memcheck_train(dtrain::dist::ProcessGroup& world, const dtrain::MemoryCheck& check) {
  dtrain::ModelParts parts{.layers = [] { return appliers_model::appliers_net(); }, .name = "net"};
  dtrain::Parallelized run = dtrain::parallelize(parts, kMemcheckPlan, world);
  torch::optim::SGD opt(run.strategy->parameters(), 0.1);
  auto source = std::make_shared<dtrain::StepStream>([](const dtrain::StepStream::Request& r) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(900 + r.step);
    at::Tensor x = at::randn({kMemcheckBatch, appliers_model::kIn}, gen);
    at::Tensor y = at::randint(0, appliers_model::kClasses, {kMemcheckBatch}, gen);
    const std::int64_t first = r.data_rank * r.batch_size;
    return dtrain::data::TensorBatch{x.slice(0, first, first + r.batch_size), y.slice(0, first, first + r.batch_size)};
  });
  dtrain::Trainer trainer(
      run.strategy, opt, source,
      {.max_steps = kMemcheckSteps, .batch_size = kMemcheckBatch / 2, .progress = false, .memory_check = check});
  trainer.set_loss(run.loss);
  return trainer.fit().steps;
}

// The planner's peak per rank for the check's plan (no limit in the way).
std::int64_t memcheck_needed() {
  namespace plan = dtrain::plan;
  const auto check = memcheck_for("");
  const auto e = plan::check_plan_memory(check.plan, check.model,
                                         {.device = plan::find_device("cpu-here"), .gpus = 2, .gpus_per_node = 2},
                                         check.cost, {.bytes = 1LL << 40, .source = "test"});
  return static_cast<std::int64_t>(e.peak());
}

}  // namespace

TEST(TrainerMemoryCheck, EveryRankRefusesWhenOneRankLacksMemoryAndTheOptOutTrains) {
  dtrain::testing::run_rank_processes(
      2,
      [](int rank) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(30)});
        const std::int64_t needed = memcheck_needed();
        const std::string tight = std::to_string(needed / 2);
        const auto check = memcheck_for(rank == 1 ? tight : "1G");
        try {
          memcheck_train(world, check);
          ADD_FAILURE() << "rank " << rank << " trained a plan that does not fit rank 1's limit";
        } catch (const dtrain::ConfigError& e) {
          const std::string what = e.what();
          EXPECT_NE(what.find("(" + std::to_string(needed) + " bytes) per rank"), std::string::npos) << what;
          EXPECT_NE(what.find("(" + tight + " bytes) a rank may use"), std::string::npos) << what;
          if (rank == 0) {
            EXPECT_NE(what.find("rank 1's limit"), std::string::npos) << what;
          }
        }
        // Off, the same limits do not stop it.
        auto off = check;
        off.enabled = false;
        EXPECT_EQ(memcheck_train(world, off), kMemcheckSteps);
        // With room on every rank it trains, and the estimate is the planner's.
        EXPECT_EQ(memcheck_train(world, memcheck_for("1G")), kMemcheckSteps);
        const auto e = dtrain::check_memory(memcheck_for("1G"), world);
        ASSERT_TRUE(e.has_value());
        EXPECT_EQ(static_cast<std::int64_t>(e->peak()), needed);
      },
      {.timeout = std::chrono::seconds(120)});
}
