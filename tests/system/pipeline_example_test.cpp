// examples/gpt --strategy pipeline end to end: every schedule on 2 stage
// processes, and a 2 x 2 data x pipeline mesh on 4 (DDP, ZeRO 1, 2 and 3 per
// stage; ZeRO-3 also as the plan --pp 2 --dp-shard 2 --zero-stage 3), end where `single` does on
// the same global batches (the stages' saved parameters, concatenated in stage
// order, against single's), with the tolerances of gpt_example_test.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "example_run.h"
#include "test_paths.h"

namespace {

namespace fs = std::filesystem;
using dtrain::testing::last_json_line;
using dtrain::testing::read_floats;

const std::string kExample = dtrain::testing::binary_dir() + "/examples/gpt";
std::string launch(int ranks) {
  return dtrain::testing::binary_dir() + "/tools/dtrain run --nproc-per-node " + std::to_string(ranks);
}

}  // namespace

TEST(GptPipelineExample, EveryScheduleAndTheMeshMatchSingle) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const auto dir = fs::temp_directory_path() / ("dtrain-gpt-pipeline-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string common =
      "--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --max-iters 4 --eval-interval 1000 --eval-iters 2 "
      "--sample-tokens 0 --warmup-iters 2 --seed 5 --devices cpu --save-params ";
  const auto single =
      dtrain::testing::run_example(kExample, common + (dir / "single.f32").string() + " --batch-size 4", "");
  ASSERT_EQ(single.exit_code, 0) << single.stderr_text;
  const std::vector<float> reference = read_floats(dir / "single.f32");
  const double single_val = last_json_line(single.stdout_text)["val_loss"].get<double>();
  struct Case {
    std::string name, args;
    int ranks, stages;
  };
  const std::vector<Case> cases{
      {"gpipe", "--pp-schedule gpipe --micro-batches 4 --batch-size 4", 2, 2},
      {"1f1b", "--pp-schedule 1f1b --micro-batches 2 --batch-size 4", 2, 2},
      {"interleaved", "--pp-schedule interleaved --micro-batches 4 --batch-size 4", 2, 4},
      {"zb", "--pp-schedule zb --micro-batches 4 --batch-size 4", 2, 2},
      {"zb-recompute", "--pp-schedule zb --micro-batches 4 --batch-size 4 --recompute full", 2, 2},
      {"mesh2x2", "--pp-schedule 1f1b --micro-batches 2 --batch-size 2 --pp-size 2", 4, 2},
      {"mesh2x2-zero2", "--pp-schedule 1f1b --micro-batches 2 --batch-size 2 --pp-size 2 --dp-reduce zero2", 4, 2},
      {"mesh2x2-zb-zero1", "--pp-schedule zb --micro-batches 2 --batch-size 2 --pp-size 2 --dp-reduce zero1", 4, 2},
      // ZeRO-3 inside the pipeline, as a plan (the stages' parameters gathered
      // once per step, kept across the micro-batches).
      {"plan-pp2-zero3", "--pp 2 --dp-shard 2 --zero-stage 3 --pp-schedule 1f1b --micro-batches 2 --batch-size 2", 4,
       2},
      {"mesh2x2-zb-zero3", "--pp-schedule zb --micro-batches 2 --batch-size 2 --pp-size 2 --dp-reduce zero3", 4, 2},
  };
  for (const auto& c : cases) {
    const auto file = dir / (c.name + ".f32");
    const auto r = dtrain::testing::run_example(kExample, common + file.string() + " --strategy pipeline " + c.args,
                                                launch(c.ranks));
    ASSERT_EQ(r.exit_code, 0) << c.name << ": " << r.stderr_text;
    const auto done = last_json_line(r.stdout_text);
    EXPECT_EQ(done.value("steps", 0), 4) << r.stdout_text;
    EXPECT_NEAR(done["val_loss"].get<double>(), single_val, 1e-4) << c.name;
    std::vector<float> params;
    for (int s = 0; s < c.stages; ++s) {
      const auto part = read_floats(file.string() + ".stage" + std::to_string(s));
      ASSERT_FALSE(part.empty()) << c.name << " stage " << s;
      params.insert(params.end(), part.begin(), part.end());
    }
    ASSERT_EQ(params.size(), reference.size()) << c.name;
    const auto diff = dtrain::testing::compare_params(params, reference);
    EXPECT_EQ(diff.outside, 0u) << c.name;
    EXPECT_LT(diff.relative_l2, 1e-5) << c.name;
  }
  fs::remove_all(dir);
}

// Under `dtrain run --max-restarts 1`, the last stage's process is SIGKILLed
// at step 3 (checkpoints every 2 steps): the group restarts, every stage
// resumes from step 2 and the run ends exactly where an uninterrupted one does.
namespace {

// `extra` arguments on `ranks` processes: a run SIGKILLed at step 3 and
// restarted resumes from the step-2 checkpoint and ends bit for bit where an
// uninterrupted run does.
void expect_killed_stage_resumes(const std::string& name, const std::string& extra, int ranks) {
  const auto dir = fs::temp_directory_path() / ("dtrain-gpt-pipeline-resume-" + name + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string common =
      "--strategy pipeline --pp-schedule 1f1b --micro-batches 2 --n-layer 2 --n-head 2 --n-embd 16 --block-size 8 "
      "--batch-size 4 --eval-interval 2 --eval-iters 1 --warmup-iters 2 --max-iters 6 --sample-tokens 0 "
      "--devices cpu " +
      extra + " --save-params ";
  const auto whole = dtrain::testing::run_example(kExample, common + (dir / "whole.f32").string(), launch(ranks));
  ASSERT_EQ(whole.exit_code, 0) << name << ": " << whole.stderr_text;
  ::setenv("DTRAIN_GPT_KILL_LAST_STAGE_AT", "3", 1);
  const auto killed = dtrain::testing::run_example(
      kExample, common + (dir / "resumed.f32").string() + " --checkpoint-dir " + (dir / "ckpt").string(),
      launch(ranks) + " --max-restarts 1");
  ::unsetenv("DTRAIN_GPT_KILL_LAST_STAGE_AT");
  ASSERT_EQ(killed.exit_code, 0) << name << ": " << killed.stderr_text;
  EXPECT_NE(killed.stderr_text.find("resumed at step 2"), std::string::npos) << name << ": " << killed.stderr_text;
  for (int s = 0; s < 2; ++s) {
    const std::string suffix = ".stage" + std::to_string(s);
    const auto a = read_floats((dir / "whole.f32").string() + suffix);
    ASSERT_FALSE(a.empty()) << name;
    EXPECT_EQ(a, read_floats((dir / "resumed.f32").string() + suffix)) << name << " stage " << s;
  }
  fs::remove_all(dir);
}

}  // namespace

TEST(GptPipelineExample, KilledStageResumesFromTheLastCheckpoint) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  expect_killed_stage_resumes("p2", "", 2);
  // 2 x 2 with sharded stages: each rank's shard of the optimizer state is its part.
  expect_killed_stage_resumes("mesh-zero2", "--pp-size 2 --dp-reduce zero2", 4);
}
