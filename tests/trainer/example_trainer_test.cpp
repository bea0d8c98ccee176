// examples/fashion_mnist on the Trainer, end to end:
//   - a 2-rank DDP run (bf16 autocast, accumulation, clipping, ranks seeded
//     seed + rank) whose rank 1 is SIGKILLed under `dtrain run` and resumed
//     from its checkpoint ends with the same parameters as an uninterrupted run;
//   - bf16 autocast reaches the fp32 accuracy within 1 point (same seed, short run).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "../system/example_run.h"
#include "../system/launch_helpers.h"
#include "test_paths.h"

using namespace dtrain::testing;

namespace {
bool have_dataset() {
  return fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

std::string done_field(const std::string& out, const std::string& field) {
  std::istringstream lines(out);
  std::string line, value;
  while (std::getline(lines, line)) {
    if (line.rfind("{\"event\":\"done\"", 0) == 0) value = nlohmann::json::parse(line)[field].dump();
  }
  return value;
}
}  // namespace

TEST(TrainerExample, ResumesBitExactAfterSigkillUnderTheLauncher) {
  if (!have_dataset()) GTEST_SKIP() << "no Fashion-MNIST";
  const std::vector<std::string> train = {
      kExample, "--strategy",   "ddp", "--epochs",           "1",   "--train-limit", "2048", "--test-limit",
      "1000",   "--batch-size", "32",  "--devices",          "cpu", "--amp",         "bf16", "--accumulate",
      "2",      "--clip-norm",  "0.5", "--checkpoint-every", "4"};
  auto run_args = [&](const fs::path& ckpt, int restarts) {
    std::vector<std::string> args{"--nproc-per-node",   "2",   "--max-restarts", std::to_string(restarts),
                                  "--monitor-interval", "0.05"};
    args.insert(args.end(), train.begin(), train.end());
    args.push_back("--checkpoint-dir");
    args.push_back(ckpt.string());
    return args;
  };
  Scratch a;
  Launch uninterrupted(run_args(a.path() / "ckpt", 0), a);
  ASSERT_EQ(uninterrupted.wait(), 0) << uninterrupted.err();
  const std::string expected = done_field(uninterrupted.out(), "params_fnv");
  ASSERT_FALSE(expected.empty()) << uninterrupted.out();
  EXPECT_EQ(done_field(uninterrupted.out(), "steps"), "16");

  Scratch s;
  Launch interrupted(run_args(s.path() / "ckpt", 1), s);
  ASSERT_TRUE(wait_for([&] { return fs::exists(s.path() / "ckpt" / "step_8"); }));
  const auto workers = interrupted.workers();
  ASSERT_EQ(workers.size(), 2u);
  ::kill(workers[1], SIGKILL);
  ASSERT_EQ(interrupted.wait(), 0) << interrupted.err();
  EXPECT_NE(interrupted.err().find("was killed by SIGKILL; restarting the workers"), std::string::npos)
      << interrupted.err();
  EXPECT_NE(interrupted.err().find("[rank 1/2] resumed from"), std::string::npos) << interrupted.err();
  EXPECT_EQ(done_field(interrupted.out(), "params_fnv"), expected) << "the resumed run ended elsewhere";
}

TEST(TrainerExample, Bf16IsWithinOnePointOfFp32) {
  if (!have_dataset()) GTEST_SKIP() << "no Fashion-MNIST";
  const std::string common = dtrain::testing::binary_dir() + "/examples/fashion_mnist";
  const std::string args = "--devices cpu --epochs 1 --train-limit 12000 --batch-size 64 --seed 2 ";
  const auto fp32 = run_example(common, args);
  const auto bf16 = run_example(common, args + "--amp bf16");
  ASSERT_EQ(fp32.exit_code, 0) << fp32.stderr_text;
  ASSERT_EQ(bf16.exit_code, 0) << bf16.stderr_text;
  const double a = last_json_line(fp32.stdout_text)["test_accuracy"];
  const double b = last_json_line(bf16.stdout_text)["test_accuracy"];
  std::cout << "fp32 accuracy " << a << ", bf16 accuracy " << b << std::endl;
  EXPECT_GT(a, 0.75);
  EXPECT_NEAR(b, a, 0.01);
}
