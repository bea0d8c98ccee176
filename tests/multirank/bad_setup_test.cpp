// Bad setups fail fast with a clear error, never hang: disagreeing world
// sizes, duplicate or missing ranks, an unreachable or busy rendezvous port,
// nccl without CUDA, mismatched subgroup lists.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/cuda.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "ranks.h"

using dtrain::dist::GroupOptions;
using dtrain::testing::free_port;
using dtrain::testing::run_rank_processes;
using dtrain::testing::run_rank_threads;
using Clock = std::chrono::steady_clock;

namespace {
// Runs `f`, expecting an exception of type E whose text contains every needle.
template <typename E, typename F>
void expect_error(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    const std::string what = e.what();
    for (const auto& n : needles) EXPECT_NE(what.find(n), std::string::npos) << "missing '" << n << "' in: " << what;
  }
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
}  // namespace

TEST(BadSetup, RanksDisagreeOnWorldSize) {
  // Rank 1 believes the world has 3 ranks. Both ranks fail well before the timeout.
  const auto start = Clock::now();
  run_rank_processes(2,
                     [](int rank) {
                       expect_error<dtrain::RendezvousError>(
                           [] { dtrain::dist::init_process_group(); },
                           {"disagree on the size of group 'world'", "rank 0 has 2", "rank 1 has 3"});
                     },
                     {.env_for_rank = [](int rank) {
                       std::map<std::string, std::optional<std::string>> env{{"DTRAIN_TIMEOUT_SECONDS", "60"}};
                       if (rank == 1) env["WORLD_SIZE"] = "3";
                       return env;
                     }});
  EXPECT_LT(seconds_since(start), 30.0);
}

TEST(BadSetup, UnreachableRendezvousTimesOutNamingHostAndPort) {
  const int port = free_port();  // nobody listens here
  run_rank_processes(
      1,
      [](int) {
        // The body runs in the child, which computes its own free_port(): read the one it was given.
        const std::string given = std::getenv("MASTER_PORT");
        const auto start = Clock::now();
        expect_error<dtrain::TimeoutError>(
            [] { dtrain::dist::init_process_group(); },
            {"[rank 1/2]", "could not reach the rendezvous store at 127.0.0.1:" + given + " within 1.5 s"});
        EXPECT_LT(seconds_since(start), 20.0);
      },
      {.env_for_rank = [port](int) {
        return std::map<std::string, std::optional<std::string>>{{"RANK", "1"},
                                                                 {"WORLD_SIZE", "2"},
                                                                 {"MASTER_PORT", std::to_string(port)},
                                                                 {"DTRAIN_TIMEOUT_SECONDS", "1.5"}};
      }});
}

TEST(BadSetup, MissingRankIsListedAfterTimeout) {
  auto store = dtrain::dist::Store::in_memory();
  const auto start = Clock::now();
  expect_error<dtrain::TimeoutError>(
      [&] { dtrain::dist::init_process_group(store, 0, 3, GroupOptions{.timeout = std::chrono::milliseconds(800)}); },
      {"only 1 of 3 ranks", "missing: [1, 2]"});
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(BadSetup, DuplicateRankIsRejected) {
  run_rank_threads(2, [](int, dtrain::dist::Store store) {
    // Both threads claim rank 0 of 2: one sees the duplicate, the other its report.
    expect_error<dtrain::RendezvousError>(
        [&] { dtrain::dist::init_process_group(store, 0, 2, GroupOptions{.timeout = std::chrono::seconds(20)}); },
        {"two processes claim rank 0"});
  });
}

TEST(BadSetup, PortAlreadyInUse) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  expect_error<dtrain::ConfigError>(
      [&] {
        dtrain::dist::init_process_group(
            dtrain::dist::EnvContract{.rank = 0, .world_size = 2, .master_addr = "127.0.0.1", .master_port = port},
            GroupOptions{.timeout = std::chrono::seconds(5)});
      },
      {"port " + std::to_string(port) + ": the port is already in use"});
  ::close(fd);
}

TEST(BadSetup, NcclWithoutCuda) {
  auto store = dtrain::dist::Store::in_memory();
  // A CPU training device can never use NCCL; without a GPU the message says so.
  const std::string needle = torch::cuda::is_available() ? "needs a CUDA training device" : "no CUDA device is visible";
  expect_error<dtrain::ConfigError>(
      [&] {
        dtrain::dist::init_process_group(
            store, 0, 1, GroupOptions{.backend = dtrain::dist::BackendKind::kNccl, .timeout = std::chrono::seconds(5)});
      },
      {"nccl backend", needle});
  if (!torch::cuda::is_available()) {
    expect_error<dtrain::ConfigError>(
        [&] {
          dtrain::dist::init_process_group(
              store, 0, 1, GroupOptions{.device = c10::Device("cuda:0"), .timeout = std::chrono::seconds(5)});
        },
        {"no CUDA device is visible"});
  }
}

TEST(BadSetup, UnknownBackendName) {
  expect_error<dtrain::ConfigError>([] { dtrain::dist::parse_backend("mpi"); }, {"unknown backend 'mpi'"});
  EXPECT_EQ(dtrain::dist::parse_backend("nccl"), dtrain::dist::BackendKind::kNccl);
}

TEST(BadSetup, SubgroupListsDisagree) {
  run_rank_threads(3, [](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, 3, GroupOptions{.timeout = std::chrono::seconds(20)});
    const std::vector<int> list = rank == 2 ? std::vector<int>{0, 2} : std::vector<int>{0, 1};
    expect_error<dtrain::RendezvousError>([&] { world.new_group(list); },
                                          {"disagree on the members of group 'world/sub0'"});
  });
}

TEST(BadSetup, SubgroupArgumentsAreValidated) {
  run_rank_threads(2, [](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, 2, GroupOptions{.timeout = std::chrono::seconds(20)});
    expect_error<dtrain::ConfigError>([&] { world.new_group({}); }, {"empty rank list"});
    expect_error<dtrain::ConfigError>([&] { world.new_group({1, 1}); }, {"duplicates"});
    expect_error<dtrain::ConfigError>([&] { world.new_group({0, 2}); }, {"rank 2, which is not in"});
  });
}
