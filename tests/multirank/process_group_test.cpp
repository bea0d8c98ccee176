// Collectives and subgroups on world sizes 1..4, with ranks as threads (in-memory
// store) and as processes (env contract, TCPStore, Gloo on loopback). Each
// result is checked against the value computed locally from every rank's input.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtrain/comm/process_group.h"

#include <map>
#include <optional>
#include "dtrain/log.h"
#include "ranks.h"

using dtrain::dist::GroupOptions;
using dtrain::dist::ProcessGroup;
using dtrain::testing::run_rank_processes;
using dtrain::testing::run_rank_threads;

namespace {
constexpr auto kTimeout = std::chrono::seconds(20);

GroupOptions options() {
  return GroupOptions{.timeout = kTimeout};
}

// Rank r's input: a length-5 (odd) tensor distinct per rank.
at::Tensor input_of(int rank) {
  return at::arange(5, at::kFloat) * static_cast<float>(rank + 1) + 0.25f;
}

void check_collectives(ProcessGroup& group) {
  const int n = group.size();
  const int r = group.rank();

  at::Tensor sum = input_of(r);
  group.all_reduce(sum).wait();
  at::Tensor expected = at::zeros({5});
  for (int i = 0; i < n; ++i) expected += input_of(i);
  EXPECT_TRUE(at::allclose(sum, expected)) << sum << expected;

  at::Tensor biggest = input_of(r);
  group.all_reduce(biggest, dtrain::dist::ReduceOp::kMax).wait();
  EXPECT_TRUE(at::equal(biggest, input_of(n - 1)));

  for (int root = 0; root < n; ++root) {
    at::Tensor t = r == root ? input_of(root) : at::zeros({5});
    group.broadcast(t, root).wait();
    EXPECT_TRUE(at::equal(t, input_of(root))) << "root " << root;
  }

  const auto gathered = group.all_gather(input_of(r));
  ASSERT_EQ(static_cast<int>(gathered.size()), n);
  for (int i = 0; i < n; ++i) EXPECT_TRUE(at::equal(gathered[static_cast<size_t>(i)], input_of(i)));

  // Empty tensors are legal and stay empty.
  at::Tensor empty = at::empty({0});
  group.all_reduce(empty).wait();
  EXPECT_EQ(empty.numel(), 0);

  group.barrier();
}

class WorldSize : public ::testing::TestWithParam<int> {};
}  // namespace

TEST_P(WorldSize, ThreadRanksCollectives) {
  const int n = GetParam();
  run_rank_threads(n, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, n, options());
    EXPECT_EQ(group.rank(), rank);
    EXPECT_EQ(group.size(), n);
    EXPECT_EQ(group.backend(), dtrain::dist::BackendKind::kGloo);
    EXPECT_EQ(dtrain::log::rank_tag(), "[rank " + std::to_string(rank) + "/" + std::to_string(n) + "]");
    check_collectives(group);
  });
}

TEST_P(WorldSize, ProcessRanksFromEnvironment) {
  const int n = GetParam();
  run_rank_processes(n, [&](int rank) {
    auto group = dtrain::dist::init_process_group(options());
    EXPECT_EQ(group.rank(), rank);
    EXPECT_EQ(group.size(), n);
    check_collectives(group);
  });
}

TEST_P(WorldSize, SubgroupsOfEvenAndOddRanks) {
  const int n = GetParam();
  run_rank_threads(n, [&](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, n, options());
    std::vector<int> evens, odds;
    for (int r = 0; r < n; ++r) (r % 2 == 0 ? evens : odds).push_back(r);
    // Every rank creates both groups, in the same order; lists in any order.
    std::reverse(evens.begin(), evens.end());
    auto even_group = world.new_group(evens);
    auto odd_group = odds.empty() ? std::nullopt : world.new_group(odds);
    auto& mine = rank % 2 == 0 ? even_group : odd_group;
    auto& other = rank % 2 == 0 ? odd_group : even_group;
    ASSERT_TRUE(mine.has_value());
    EXPECT_FALSE(other.has_value());
    const auto& members = mine->world_ranks();
    EXPECT_EQ(members[static_cast<size_t>(mine->rank())], rank);
    at::Tensor t = input_of(rank);
    mine->all_reduce(t).wait();
    at::Tensor expected = at::zeros({5});
    for (int m : members) expected += input_of(m);
    EXPECT_TRUE(at::allclose(t, expected));
    // A subgroup of a subgroup maps back to world ranks.
    auto first_only = mine->new_group({0});
    ASSERT_EQ(first_only.has_value(), mine->rank() == 0);
    if (first_only) {
      EXPECT_EQ(first_only->world_ranks(), std::vector<int>{members.front()});
    }
    world.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Sweep, WorldSize, ::testing::Values(1, 2, 3, 4));

TEST(TorchrunContract, AgentHostedStoreSurvivesRestartRounds) {
  // torchrun's agent hosts the store on MASTER_PORT for the whole job and
  // sets TORCHELASTIC_USE_AGENT_STORE; each restart round must start cleanly
  // on the same store. Here the test process plays the agent.
  const bool child = std::getenv("DTRAIN_TEST_CHILD") != nullptr;
  std::optional<dtrain::dist::Store> agent;
  int port = 0;
  if (!child) {
    agent = dtrain::dist::Store::tcp({.port = 0, .is_server = true, .timeout = std::chrono::seconds(30)});
    port = agent->port();
  }
  for (int round = 0; round < 2; ++round) {
    run_rank_processes(2,
                       [](int rank) {
                         auto group = dtrain::dist::init_process_group(options());
                         check_collectives(group);
                       },
                       {.env_for_rank = [&](int) {
                         return std::map<std::string, std::optional<std::string>>{
                             {"MASTER_PORT", std::to_string(port)},
                             {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                             {"TORCHELASTIC_RESTART_COUNT", std::to_string(round)}};
                       }});
  }
}

// Rank threads making and using new Gloo groups at once: every group's first
// collective registers the group in c10d's process-wide flight recorder, which
// torch 2.11 does outside its lock (src/core/torch_compat.h,
// c10d_flight_recorder_off_by_default). This crashed there with the recorder
// on (TORCH_FR_BUFFER_SIZE=2000 set by hand) and must pass as dtrain sets it.
TEST(GlooGroups, RankThreadsCreatingGroupsAtOnce) {
  constexpr int kWorld = 4;
  constexpr int kGroups = 40;
  run_rank_threads(kWorld, [&](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, kWorld, options());
    for (int i = 0; i < kGroups; ++i) {
      auto group = world.new_group({0, 1, 2, 3});
      ASSERT_TRUE(group.has_value());
      at::Tensor t = at::full({3}, static_cast<float>(rank + i));
      group->all_reduce(t).wait();
      EXPECT_TRUE(at::equal(t, at::full({3}, static_cast<float>(kWorld * i + 6)))) << "group " << i;
    }
    world.barrier();
  });
}
