// examples/gpt's memory pre-flight (the Trainer's, TrainerOptions::
// memory_check, set by examples/common/plan_cli.h): under a stated limit
// (DTRAIN_MEMORY_LIMIT) smaller than the plan's predicted peak, the run stops
// before training with the bytes the planner says the plan needs (the same
// figure dtrain::plan computes here) and the nearest plan that fits;
// --no-memory-check trains anyway. On two ranks whose limits differ, both
// refuse (Note [One pre-flight decision] in src/trainer/memory_check.cpp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "dtrain/nn/attention.h"
#include "dtrain/plan/preflight.h"
#include "example_run.h"
#include "test_paths.h"

namespace {

std::int64_t preflight_corpus_vocab() {
  const char* cache = std::getenv("DTRAIN_CACHE");
  const char* home = std::getenv("HOME");
  const std::string dir = cache != nullptr ? cache : std::string(home != nullptr ? home : ".") + "/.cache/dtrain";
  std::ifstream meta_file(dir + "/shakespeare_char/meta.json");
  return nlohmann::json::parse(meta_file).at("vocab_size").get<std::int64_t>();
}

const std::string kPreflightGpt = dtrain::testing::binary_dir() + "/examples/gpt";
const std::string kPreflightArgs =
    "--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 4 --max-iters 1 --eval-interval 100 "
    "--eval-iters 1 --devices cpu --sample-tokens 0 --dp-replicate 1";

// The example's model as the planner sees it (as examples/gpt/main.cpp
// describes it); the vocabulary is the corpus's.
dtrain::plan::ModelSpec preflight_model() {
  const bool materialized = dtrain::nn::attention_materializes_scores(16);
  return dtrain::plan::ModelSpec::parse(
      "gpt:layers=2,hidden=32,heads=2,seq=16,vocab=" + std::to_string(preflight_corpus_vocab()) +
      ",attention=" + (materialized ? "materialized" : "flash") + ",kernels=eager,dropout=0,bias=0");
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
      "DTRAIN_MEMORY_LIMIT=" + limit + " " + dtrain::testing::binary_dir() + "/tools/dtrain run --nproc-per-node 2");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.stderr_text.find("(" + std::to_string(needed) + " bytes)"), std::string::npos)
      << refused.stderr_text;
}

// Rank 1 may use half of what the plan needs, rank 0 a thousand times it:
// every rank refuses before training, rank 0 naming rank 1's limit (each
// deciding alone, rank 0 would go on and wait in its first collective for a
// rank that has stopped).
TEST(PlanPreflight, RanksRefuseTogetherWhenOneRankHasTooLittle) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const dtrain::ParallelPlan p{.dp_replicate = 2, .precision = "fp32", .global_batch = 8};
  const auto needed = planned_peak(p, 2);
  const std::string small = std::to_string(needed / 2), large = std::to_string(needed * 1000);
  // The launcher gives every rank one environment: a script sets each rank's limit.
  const auto script = std::filesystem::temp_directory_path() / ("dtrain-preflight-" + std::to_string(::getpid()));
  {
    std::ofstream out(script);
    out << "#!/bin/sh\nif [ \"$RANK\" = 1 ]; then DTRAIN_MEMORY_LIMIT=" << small
        << "; else DTRAIN_MEMORY_LIMIT=" << large << "; fi\nexport DTRAIN_MEMORY_LIMIT\nexec " << kPreflightGpt
        << " \"$@\"\n";
  }
  std::filesystem::permissions(script, std::filesystem::perms::owner_all);
  std::string args = kPreflightArgs;
  args.replace(args.find("--dp-replicate 1"), 16, "--dp-replicate 2");
  const auto r = dtrain::testing::run_example(
      script.string(), args, "timeout 120 " + dtrain::testing::binary_dir() + "/tools/dtrain run --nproc-per-node 2");
  std::filesystem::remove(script);
  const std::string all = r.stdout_text + r.stderr_text;
  EXPECT_NE(r.exit_code, 0) << all;
  EXPECT_NE(r.exit_code, 124) << "a rank hung: " << all;  // timeout's code
  EXPECT_EQ(all.find("\"event\":\"done\""), std::string::npos) << all;
  // Rank 1 refuses on its own limit, rank 0 on rank 1's, both with the figure.
  EXPECT_NE(all.find("DTRAIN_MEMORY_LIMIT=" + small), std::string::npos) << all;
  EXPECT_NE(all.find("rank 1's limit, the least of the 2 ranks'"), std::string::npos) << all;
  std::size_t refusals = 0;
  for (std::size_t at = all.find("(" + std::to_string(needed) + " bytes)"); at != std::string::npos;
       at = all.find("(" + std::to_string(needed) + " bytes)", at + 1))
    ++refusals;
  EXPECT_GE(refusals, 2U) << all;
}

}  // namespace
