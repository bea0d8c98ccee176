// A program that knows nothing of dtrain runs under `dtrain run`: plain
// PyTorch DDP (tests/system/plain_ddp.py: torch's env:// rendezvous, gloo,
// the pinned torch in DTRAIN_PYTHON) on one node, after a restart, and on two
// "nodes" on loopback. Every rank writes its parameters after checking that
// all replicas agree; the test compares the files across ranks too.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "launch_helpers.h"
#include "ranks.h"
#include "test_paths.h"

using namespace dtrain::testing;

namespace {
const std::string kPython = DTRAIN_PYTHON;
const std::string kScript = dtrain::testing::source_dir() + "/tests/system/plain_ddp.py";
// Python workers start slowly (importing torch) on a loaded machine.
constexpr auto kRunTimeout = std::chrono::seconds(240);

// Reads result_<rank>.json for ranks 0..world-1 and checks that every rank saw
// `world` ranks in attempt `attempt` and holds the same parameters as rank 0.
void expect_replicas_agree(const fs::path& dir, int world, int attempt) {
  nlohmann::json first;
  for (int r = 0; r < world; ++r) {
    const auto path = dir / ("result_" + std::to_string(r) + ".json");
    ASSERT_TRUE(fs::exists(path)) << "rank " << r << " wrote no result";
    const auto j = nlohmann::json::parse(slurp(path));
    EXPECT_EQ(j.at("world").get<int>(), world);
    EXPECT_EQ(j.at("attempt").get<int>(), attempt);
    if (r == 0) {
      first = j.at("params");
      EXPECT_EQ(first.size(), 8u * 4u + 4u);  // nn.Linear(8, 4)
    } else {
      EXPECT_EQ(j.at("params"), first) << "rank " << r << " differs from rank 0";
    }
  }
}

class PlainTorch : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("PLAIN_DDP_DIR", scratch_.path().c_str(), 1);
    ::unsetenv("PLAIN_DDP_FAIL_RANK");
  }
  void TearDown() override { ::unsetenv("PLAIN_DDP_FAIL_RANK"); }
  Scratch scratch_;
};
}  // namespace

TEST_F(PlainTorch, DdpScriptRunsOnOneNode) {
  Launch l({"--nproc-per-node", "2", kPython, kScript}, scratch_);
  ASSERT_EQ(l.wait(kRunTimeout), 0) << l.out() << l.err();
  expect_replicas_agree(scratch_.path(), 2, 0);
}

TEST_F(PlainTorch, DdpScriptSucceedsAfterARestart) {
  ::setenv("PLAIN_DDP_FAIL_RANK", "1", 1);  // rank 1 exits 1 in attempt 0, after joining the group
  Launch l({"--nproc-per-node", "2", "--max-restarts", "1", "--stop-grace", "2", kPython, kScript}, scratch_);
  ASSERT_EQ(l.wait(kRunTimeout), 0) << l.out() << l.err();
  EXPECT_NE(l.err().find("restarting the workers (restart 1 of 1)"), std::string::npos) << l.err();
  expect_replicas_agree(scratch_.path(), 2, 1);
}

TEST_F(PlainTorch, DdpScriptRunsOnTwoNodes) {
  const int port = free_port();
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  auto node = [&](const std::string& rank) {
    std::vector<std::string> args = {"--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint};
    args.insert(args.end(), {"--rdzv-id", "plain", "--node-rank", rank, "--rdzv-timeout", "120"});
    args.insert(args.end(), {"--rdzv-conf", "last_call_timeout=1", kPython, kScript});
    return args;
  };
  Launch a(node("0"), scratch_, "a");
  Launch b(node("1"), scratch_, "b");
  EXPECT_EQ(a.wait(kRunTimeout), 0) << a.err();
  EXPECT_EQ(b.wait(kRunTimeout), 0) << b.err();
  expect_replicas_agree(scratch_.path(), 4, 0);
}
