// ZeRO training across a membership change: two `dtrain run` nodes of two
// workers (4 ranks) train ZeRO-3 with a sharded checkpoint per step; one
// node is killed mid-training; the survivor's two ranks resume from the
// 4-rank checkpoint and finish; the final model equals an uninterrupted
// single-process run on the same global batches (nothing lost or repeated).
#include <gtest/gtest.h>
#include <torch/serialize/archive.h>

#include <regex>
#include <set>

#include "launch_helpers.h"
#include "ranks.h"
#include "test_paths.h"
#include "zero_helpers.h"

using namespace dtrain::testing;

namespace {

const std::string kZeroWorker = dtrain::testing::binary_dir() + "/tests/dtrain_zero_elastic_worker";

// (world size, last step) per line of steps.log.
std::vector<std::pair<int, int>> progress(const fs::path& dir) {
  std::vector<std::pair<int, int>> out;
  std::istringstream in(slurp(dir / "steps.log"));
  std::string line;
  const std::regex re("round \\S+ world (\\d+) rank \\d+ step (\\d+)");
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_match(line, m, re)) out.emplace_back(std::stoi(m[1]), std::stoi(m[2]));
  }
  return out;
}

}  // namespace

TEST(ZeroElastic, SurvivorsResumeFromTheShardedCheckpoint) {
  constexpr int kSteps = 40;
  Scratch s;
  const int port = free_port();
  ::setenv("ELASTIC_DIR", s.path().c_str(), 1);
  ::setenv("ELASTIC_STEPS", std::to_string(kSteps).c_str(), 1);
  ::setenv("ELASTIC_STEP_MS", "100", 1);
  ::setenv("DTRAIN_TIMEOUT_SECONDS", "20", 1);
  const std::vector<std::string> args{
      "--nnodes",         "1:2",
      "--nproc-per-node", "2",
      "--rdzv-endpoint",  "127.0.0.1:" + std::to_string(port),
      "--rdzv-id",        "zero",
      "--rdzv-conf",      "last_call_timeout=1,heartbeat_interval=0.25,heartbeat_timeout=3",
      "--rdzv-timeout",   "60",
      "--max-restarts",   "0",
      "--stop-grace",     "2",
      kZeroWorker};
  Launch a(args, s, "a");
  ASSERT_TRUE(wait_for([&] { return a.err().find("hosting the rendezvous store") != std::string::npos; })) << a.err();
  Launch b(args, s, "b");
  auto steps_at_world = [&](int world) {
    int n = 0;
    for (const auto& [w, step] : progress(s.path())) n += w == world ? 1 : 0;
    return n;
  };
  ASSERT_TRUE(wait_for([&] { return steps_at_world(4) >= 4 * 5; })) << a.err() << b.err();  // 5 steps on 4 ranks
  ::kill(b.pid(), SIGKILL);
  b.wait();
  EXPECT_EQ(a.wait(), 0) << a.err();
  EXPECT_GT(steps_at_world(2), 0) << "the survivors trained on as 2 ranks";
  EXPECT_NE(a.err().find("saved by 4 ranks"), std::string::npos) << a.err();  // resharded 4 -> 2
  int last = -1;
  for (const auto& [w, step] : progress(s.path())) last = std::max(last, step);
  EXPECT_EQ(last, kSteps - 1);

  auto reference = zero::make_model();
  auto opt = zero::make_optimizer(zero::OptimizerKind::kAdamW, zero::trainable(*reference));
  for (int step = 0; step < kSteps; ++step) {
    const zero::Batch batch = zero::global_batch(step, 12);
    opt->zero_grad();
    zero::loss_of(reference->forward(batch.x), batch.y).backward();
    opt->step();
  }
  torch::serialize::InputArchive archive;
  archive.load_from((s.path() / "final.pt").string());
  std::map<std::string, at::Tensor> final_params;
  for (const auto& key : archive.keys()) archive.read(key, final_params[key]);
  zero::expect_equal_parameters(final_params, *reference, 1e-4, 1e-5);
}
