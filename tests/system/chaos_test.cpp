// The chaos soak's short version (bench/chaos/chaos.py; the long one is
// `scripts/bench.sh chaos`): three `dtrain run` nodes in network namespaces
// train the Fashion-MNIST example with DDP and checkpoints while one fault of
// each kind is injected at seeded random times: a worker SIGKILLed, a worker
// SIGSTOPped, a node SIGKILLed, the store's host SIGKILLed, a node's link cut
// for twice the heartbeat timeout, and the checkpoint tmpfs filled. The run
// must finish, its final checkpoint must load to the same parameters, and no
// example may be trained on twice or skipped in any epoch.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

namespace {
std::string run_and_capture(const std::string& command, int* status) {
  std::string out;
  FILE* pipe = ::popen(command.c_str(), "r");
  std::array<char, 4096> buf{};
  while (pipe != nullptr && std::fgets(buf.data(), buf.size(), pipe) != nullptr) out += buf.data();
  *status = pipe != nullptr ? ::pclose(pipe) : -1;
  return out;
}
}  // namespace

TEST(Chaos, OneFaultOfEachKindIsSurvivedWithoutLosingOrRepeatingExamples) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist not installed";
  }
  if (::geteuid() != 0 || std::system("ip netns list >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "needs root and iproute2 (network namespaces, link cuts, a tmpfs for the full disk)";
  }
  int status = 0;
  const std::string out =
      run_and_capture(std::string(DTRAIN_PYTHON) + " " + DTRAIN_SOURCE_DIR + "/bench/chaos/chaos.py --build " +
                          DTRAIN_BINARY_DIR + " --faults 6 --epochs 3 --gap-min 4 --gap-max 6 --seed 2 2>&1",
                      &status);
  const auto last = out.rfind("{\"bench\": \"chaos\"");
  ASSERT_NE(last, std::string::npos) << out;
  const auto r = nlohmann::json::parse(out.substr(last, out.find('\n', last) - last));
  EXPECT_TRUE(r["namespaces"].get<bool>()) << out;
  EXPECT_TRUE(r["finished"].get<bool>()) << out;
  EXPECT_TRUE(r["checkpoint_loads"].get<bool>()) << out;
  EXPECT_TRUE(r["samples_ok"].get<bool>()) << r["audit"].dump();
  EXPECT_TRUE(r["not_fired"].empty()) << out;
  // One of each kind of the default mix (the overlapping kinds of --overlap
  // are reported too, at 0).
  for (const char* kind : {"worker_kill", "worker_stop", "node_kill", "store_host_kill", "link_cut", "disk_full"}) {
    EXPECT_EQ(r["injected"].value(kind, 0), 1) << kind << "\n" << out;
    EXPECT_EQ(r["survived"].value(kind, 0), 1) << kind;
  }
  for (const auto& [kind, n] : r["injected"].items()) EXPECT_EQ(n.get<int>(), r["survived"][kind].get<int>()) << kind;
  EXPECT_EQ(status, 0) << out;
}
