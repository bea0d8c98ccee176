// FaultTolerantReplicas with replica groups of two ranks, as threads over an
// in-memory store (issue 27, review defect a): a recovery that completes on
// one rank of a group and fails on the other must not leave the group's
// ranks at different steps. The group agrees on its step (the minimum over
// its ranks) before it asks for a quorum, so both ranks recover again.
#include <gtest/gtest.h>
#include <torch/serialize/archive.h>

#include <atomic>
#include <thread>

#include "dtrain/comm/process_group.h"
#include "dtrain/ft/lighthouse.h"
#include "dtrain/ft/replicas.h"
#include "ranks.h"

namespace dtrain::ft {
namespace {

using std::chrono::milliseconds;

TEST(FtReplicas, HalfRecoveredReplicaGroupRecoversAgainOnEveryRank) {
  constexpr int kSteps = 10;
  constexpr int kRanksPerGroup = 2;
  auto store = dist::Store::in_memory();
  Lighthouse lighthouse(store, {.min_replicas = 1,
                                .heartbeat_timeout = milliseconds(1000),
                                .join_timeout = milliseconds(5000),
                                .scan_interval = milliseconds(10)});
  std::atomic<std::int64_t> b_step{0};
  std::atomic<bool> load_failed_once{false};
  std::atomic<bool> a_started{false};
  std::vector<std::int64_t> final_step(4, -1);
  std::vector<at::Tensor> final_w(4);
  std::vector<int> recoveries(4, 0);
  // Ranks 0-1: replica group 0 (joins late, behind); ranks 2-3: replica group 1.
  testing::run_rank_threads(4, [&](int rank, dist::Store) {
    const int replica = rank / kRanksPerGroup;
    const int local = rank % kRanksPerGroup;
    if (replica == 0) {
      while (b_step.load() < 2) std::this_thread::sleep_for(milliseconds(5));
    }
    auto group = dist::init_process_group(store.with_prefix("group" + std::to_string(replica)), local, kRanksPerGroup,
                                          {.timeout = milliseconds(10000)});
    LighthouseClient client(store, store, {.replica_id = replica, .commit_timeout = milliseconds(3000)});
    at::Tensor w = at::zeros({4});
    ReplicaState state{.save = [&](torch::serialize::OutputArchive& a) { a.write("w", w); },
                       .load =
                           [&](torch::serialize::InputArchive& a) {
                             // Rank 1 of the late group fails its first load (after receiving
                             // every byte), as a rank that runs out of memory would.
                             if (replica == 0 && local == 1 && !load_failed_once.exchange(true)) {
                               throw std::runtime_error("injected: loading the peer's state failed");
                             }
                             at::Tensor got;
                             a.read("w", got);
                             w.copy_(got);
                           }};
    FaultTolerantReplicas replicas(client, state, {.replica_group = group, .group_timeout = milliseconds(2000)});
    if (replica == 0) a_started = true;
    while (replicas.step() < kSteps) {
      replicas.start_step();
      if (replicas.recovered()) ++recoveries[rank];
      if (replica == 1 && replicas.quorum().members.size() < 2) {
        // Alone: slowly to step 2, then wait for group 0 to ask.
        if (replicas.step() >= 2) {
          while (!a_started.load()) std::this_thread::sleep_for(milliseconds(5));
          std::this_thread::sleep_for(milliseconds(200));
        } else {
          std::this_thread::sleep_for(milliseconds(20));
        }
      }
      std::vector<at::Tensor> grads{at::full({4}, static_cast<float>(replicas.step() + 1))};
      replicas.all_reduce_gradients(grads);
      if (!replicas.should_commit()) continue;
      w -= grads[0];
      if (replica == 1 && local == 0) b_step = replicas.step();
    }
    final_step[rank] = replicas.step();
    final_w[rank] = w;
  });
  // w = -(1 + 2 + ... + kSteps) on every rank: each committed step once.
  const at::Tensor expected = at::full({4}, -static_cast<float>(kSteps * (kSteps + 1) / 2));
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(final_step[rank], kSteps) << "rank " << rank;
    EXPECT_TRUE(at::equal(final_w[rank], expected)) << "rank " << rank << ": " << final_w[rank];
  }
  EXPECT_TRUE(load_failed_once.load());
  EXPECT_EQ(recoveries[0], 2) << "rank 0 recovered, the step aborted, and it recovers again with rank 1";
  EXPECT_EQ(recoveries[1], 1);
  lighthouse.check();
}

}  // namespace
}  // namespace dtrain::ft
