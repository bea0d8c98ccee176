// The Trainer's memory pre-flight (TrainerOptions::memory_check) on 2
// processes: with rank 1's limit under the plan's predicted peak and rank 0's
// far above it, both ranks refuse before any step (neither waits for the
// other in a collective: the test's timeout), each with the planner's
// figure, rank 0 naming rank 1's limit; turned off, the same run trains; with
// room on both, it trains and check_memory's estimate is the planner's.
#include <c10/core/CachingDeviceAllocator.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

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

// An accelerator as c10 sees one: an allocator for PrivateUse1 that tells
// its free and total memory (or, `tells` false, does not, as c10's default).
struct FakeAccelerator final : c10::DeviceAllocator {
  std::size_t free = 0, total = 0;
  std::int64_t held = 0;
  bool tells = true;
  c10::DataPtr allocate(std::size_t /*n*/) override { TORCH_CHECK(false, "the fake accelerator allocates nothing"); }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {}
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {}
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex /*device*/) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    stats.reserved_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current = held;
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex /*device*/) override {}
  void resetPeakStats(c10::DeviceIndex /*device*/) override {}
  std::pair<std::size_t, std::size_t> getMemoryInfo(c10::DeviceIndex device) override {
    if (!tells) return c10::DeviceAllocator::getMemoryInfo(device);
    return {free, total};
  }
};

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

// On an accelerator the limit is the device's own figure: its free memory
// plus what this process already holds there, not the device table's or the
// host's; a plan above it is refused naming the device, one under it runs;
// an allocator that cannot tell falls back to the device table's device
// (here the host's memory), with a warning.
TEST(TrainerMemoryCheck, AnAcceleratorsOwnFreeMemoryIsTheLimit) {
  static FakeAccelerator accelerator;
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &accelerator, /*priority=*/255);
  const c10::Device device(c10::DeviceType::PrivateUse1, 0);
  dtrain::MemoryCheck check{.plan = {.precision = "fp32", .global_batch = 6},
                            .model = dtrain::plan::ModelSpec::parse("gpt:layers=2,hidden=32,heads=2,seq=16,vocab=65"),
                            .runs_on = device,
                            .local_ranks = 1};
  namespace plan = dtrain::plan;
  const auto needed = static_cast<std::int64_t>(
      plan::check_plan_memory(check.plan, check.model, {.device = plan::find_device("cpu-here"), .gpus = 1}, check.cost,
                              {.bytes = 1LL << 40, .source = "test"})
          .peak());
  accelerator.total = 8 * static_cast<std::size_t>(needed);
  accelerator.held = needed / 4;
  accelerator.free = static_cast<std::size_t>(needed / 2);  // free + held: 3/4 of the need

  const auto limit = dtrain::agreed_memory_limit(check, std::nullopt);
  EXPECT_EQ(limit.bytes, needed / 2 + needed / 4);
  EXPECT_NE(limit.source.find(device.str() + "'s free memory"), std::string::npos) << limit.source;
  try {
    dtrain::check_memory(check, std::nullopt);
    ADD_FAILURE() << "a plan needing " << needed << " bytes ran with " << limit.bytes;
  } catch (const dtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(device.str()), std::string::npos) << e.what();
  }

  accelerator.free = static_cast<std::size_t>(needed);  // free + held: 5/4 of the need
  const auto fits = dtrain::check_memory(check, std::nullopt);
  ASSERT_TRUE(fits.has_value());
  EXPECT_EQ(static_cast<std::int64_t>(fits->peak()), needed);

  accelerator.tells = false;
  EXPECT_NE(dtrain::agreed_memory_limit(check, std::nullopt).source.find("this host's available memory"),
            std::string::npos);
}
