// examples/gpt's memory pre-flight (examples/common/plan_cli.h, Note [Memory
// pre-flight]): under a stated limit (DTRAIN_MEMORY_LIMIT) smaller than the
// plan's predicted peak, the run stops before training with the bytes the
// planner says the plan needs (the same figure dtrain::plan computes here)
// and the nearest plan that fits; --no-memory-check trains anyway.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "dtrain/plan/preflight.h"
#include "example_run.h"

namespace {

const std::string kPreflightGpt = std::string(DTRAIN_BINARY_DIR) + "/examples/gpt";
const std::string kPreflightArgs =
    "--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 4 --max-iters 1 --eval-interval 100 "
    "--eval-iters 1 --devices cpu --sample-tokens 0 --dp-replicate 1";

// The example's model as the planner sees it; the vocabulary is the corpus's.
dtrain::plan::ModelSpec preflight_model() {
  const char* cache = std::getenv("DTRAIN_CACHE");
  const char* home = std::getenv("HOME");
  const std::string dir = cache != nullptr ? cache : std::string(home != nullptr ? home : ".") + "/.cache/dtrain";
  std::ifstream meta_file(dir + "/shakespeare_char/meta.json");
  const auto vocab = nlohmann::json::parse(meta_file).at("vocab_size").get<std::int64_t>();
  return dtrain::plan::ModelSpec::parse("gpt:layers=2,hidden=32,heads=2,seq=16,vocab=" + std::to_string(vocab) +
                                        ",attention=flash,kernels=eager,dropout=0,bias=0");
}

// The planner's peak per rank for `p` on `gpus` CPU ranks of this host.
std::int64_t planned_peak(const dtrain::ParallelPlan& p, int gpus) {
  namespace plan = dtrain::plan;
  const auto e = plan::check_plan_memory(
      p, preflight_model(), {.device = plan::find_device("cpu-here"), .gpus = gpus, .gpus_per_node = gpus},
      {.weights = plan::WeightLayout::kFp32Master, .ddp_buckets_copy_gradients = true},
      {.bytes = 1LL << 40, .source = "test"});
  return static_cast<std::int64_t>(e.peak());
}

TEST(PlanPreflight, GptRefusesAPlanOverTheLimitAndRunsWithNoMemoryCheck) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const auto needed = planned_peak({.precision = "fp32", .global_batch = 4}, 1);
  const std::string limit = std::to_string(needed / 2);

  const auto refused =
      dtrain::testing::run_example("DTRAIN_MEMORY_LIMIT=" + limit + " " + kPreflightGpt, kPreflightArgs);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.stderr_text.find("needs"), std::string::npos) << refused.stderr_text;
  EXPECT_NE(refused.stderr_text.find("(" + std::to_string(needed) + " bytes)"), std::string::npos)
      << refused.stderr_text;
  EXPECT_NE(refused.stderr_text.find("DTRAIN_MEMORY_LIMIT=" + limit), std::string::npos) << refused.stderr_text;
  EXPECT_EQ(refused.stdout_text.find("\"event\":\"done\""), std::string::npos);

  const auto forced = dtrain::testing::run_example("DTRAIN_MEMORY_LIMIT=" + limit + " " + kPreflightGpt,
                                                   kPreflightArgs + " --no-memory-check");
  EXPECT_EQ(forced.exit_code, 0) << forced.stderr_text;
  EXPECT_NE(forced.stdout_text.find("\"event\":\"done\""), std::string::npos) << forced.stdout_text;
}

// A pipeline's micro-batches split the rank's batch: the pre-flight costs
// the plan with --batch-size sequences per step, not --micro-batches times
// as many (which made its activations 4x too large here).
TEST(PlanPreflight, PipelineCostsItsMicroBatchesAsASplitOfTheBatch) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const dtrain::ParallelPlan p{
      .pp = 2, .pipeline = {.schedule = "gpipe", .micro_batches = 4}, .precision = "fp32", .global_batch = 4};
  const auto needed = planned_peak(p, 2);
  auto inflated = p;
  inflated.global_batch = 16;
  ASSERT_GT(planned_peak(inflated, 2), needed) << "the case must tell the two batch sizes apart";
  const std::string limit = std::to_string(needed / 2);
  const auto refused = dtrain::testing::run_example(
      kPreflightGpt, kPreflightArgs + " --pp 2 --pp-schedule gpipe --micro-batches 4",
      "DTRAIN_MEMORY_LIMIT=" + limit + " " + std::string(DTRAIN_BINARY_DIR) + "/tools/dtrain run --nproc-per-node 2");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.stderr_text.find("(" + std::to_string(needed) + " bytes)"), std::string::npos)
      << refused.stderr_text;
}

}  // namespace
