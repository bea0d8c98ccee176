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

TEST(PlanPreflight, GptRefusesAPlanOverTheLimitAndRunsWithNoMemoryCheck) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  namespace plan = dtrain::plan;
  // The example's model as the planner sees it; the vocabulary is the corpus's.
  const char* cache = std::getenv("DTRAIN_CACHE");
  const char* home = std::getenv("HOME");
  const std::string dir = cache != nullptr ? cache : std::string(home != nullptr ? home : ".") + "/.cache/dtrain";
  std::ifstream meta_file(dir + "/shakespeare_char/meta.json");
  const auto vocab = nlohmann::json::parse(meta_file).at("vocab_size").get<std::int64_t>();
  const auto model = plan::ModelSpec::parse("gpt:layers=2,hidden=32,heads=2,seq=16,vocab=" + std::to_string(vocab) +
                                            ",attention=flash,kernels=eager,dropout=0,bias=0");
  const dtrain::ParallelPlan p{.precision = "fp32", .global_batch = 4};
  const auto e =
      plan::check_plan_memory(p, model, {.device = plan::find_device("cpu-here"), .gpus = 1, .gpus_per_node = 1},
                              {.weights = plan::WeightLayout::kFp32Master, .ddp_buckets_copy_gradients = true},
                              {.bytes = 1LL << 40, .source = "test"});
  const auto needed = static_cast<std::int64_t>(e.peak());
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

}  // namespace
