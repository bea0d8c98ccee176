// `dtrain plan` end to end: the Megatron 145.6B command prints one
// JSON object per plan with the pinned degrees and a throughput near the
// published 148 TFLOP/s per GPU; the whole search for 1,024 GPUs finishes
// (its time is reported by bench, not asserted here); bad input exits
// non-zero with the reason.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include "test_paths.h"

namespace {

struct Output {
  int exit_code = -1;
  std::string text;  // stdout and stderr
};

Output run_plan(const std::string& args) {
  const std::string cmd = dtrain::testing::binary_dir() + "/tools/dtrain plan " + args + " 2>&1";
  Output out;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return out;
  std::array<char, 4096> buf{};
  std::size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) out.text.append(buf.data(), n);
  const int status = ::pclose(pipe);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

const std::string kMegatron =
    "--model gpt:layers=80,hidden=12288,heads=96,seq=2048,vocab=51200 --device a100-80gb --gpus 1536 "
    "--gpus-per-node 8 --global-batch 2304 --precision bf16 ";

}  // namespace

TEST(PlanCli, MegatronCommandPrintsJsonPlansWithThePinnedDegrees) {
  const auto r =
      run_plan(kMegatron + "--fixed \"tp=8,pp=8,dp=24,micro_batch=1,schedule=interleaved,recompute=full\" --json");
  ASSERT_EQ(r.exit_code, 0) << r.text;
  std::istringstream lines(r.text);
  std::string line;
  int plans = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line.front() != '{') continue;
    const auto j = nlohmann::json::parse(line);
    ++plans;
    EXPECT_EQ(j.at("plan").at("tp"), 8);
    EXPECT_EQ(j.at("plan").at("pp"), 8);
    EXPECT_EQ(j.at("plan").at("dp_replicate").get<int>() * j.at("plan").at("dp_shard").get<int>(), 24);
    EXPECT_EQ(j.at("plan").at("pipeline").at("schedule"), "interleaved");
    EXPECT_EQ(j.at("peak_memory_bytes").size(), 8u);  // one per pipeline stage rank
    for (const char* key : {"step_seconds", "tokens_per_second", "tflops_per_gpu", "mfu"})
      EXPECT_TRUE(j.contains(key)) << key;
    const double tflops = j.at("tflops_per_gpu").get<double>();
    EXPECT_GT(tflops, 148.0 * 0.7) << line;
    EXPECT_LT(tflops, 148.0 * 1.3) << line;
  }
  EXPECT_GT(plans, 0) << r.text;
}

TEST(PlanCli, BadInputExitsNonZeroWithTheReason) {
  const auto device = run_plan(
      "--model gpt:layers=80,hidden=12288,heads=96,seq=2048,vocab=51200 --device a100-81gb --gpus 8 --global-batch 8");
  EXPECT_NE(device.exit_code, 0);
  EXPECT_NE(device.text.find("a100-81gb"), std::string::npos) << device.text;
  const auto missing = run_plan("--model gpt:layers=2,hidden=64,heads=2,seq=16,vocab=65 --device h100-80gb");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.text.find("--gpus"), std::string::npos) << missing.text;
}
