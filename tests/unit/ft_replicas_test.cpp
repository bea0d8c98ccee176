// FaultTolerantReplicas with replica groups of two ranks, as threads over an
// in-memory store (issue 27, review defect a): a recovery that completes on
// one rank of a group and fails on the other must not leave the group's
// ranks at different steps. The group agrees on its step (the minimum over
// its ranks) before it asks for a quorum, so both ranks recover again.
#include <gtest/gtest.h>
#include <torch/serialize/archive.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "dtrain/comm/process_group.h"
#include "dtrain/ft/lighthouse.h"
#include "dtrain/ft/replicas.h"
#include "ranks.h"

namespace dtrain::ft {
namespace {

using std::chrono::milliseconds;

// Three replicas' lighthouse with a 300 ms heartbeat timeout: a dead or
// silent member is noticed long before any group timeout of these tests.
LighthouseOptions three_replicas_quick_heartbeats() {
  return {.min_replicas = 1,
          .startup_replicas = 3,
          .heartbeat_timeout = milliseconds(300),
          .join_timeout = milliseconds(5000),
          .scan_interval = milliseconds(10)};
}

// Steps `replicas` until its step is `last`, each with a gradient of ones:
// counts the aborted steps in `aborted` and calls `committed` after each
// committed one.
void step_until(FaultTolerantReplicas& replicas, std::int64_t last, int& aborted,
                const std::function<void()>& committed) {
  while (replicas.step() < last) {
    replicas.start_step();
    std::vector<at::Tensor> grads{at::ones({2})};
    replicas.all_reduce_gradients(grads);
    if (!replicas.should_commit()) {
      ++aborted;
      continue;
    }
    committed();
  }
}

// A replica whose whole state is the tensor `w`.
ReplicaState state_of(at::Tensor& w) {
  return ReplicaState{.save = [&w](torch::serialize::OutputArchive& a) { a.write("w", w); },
                      .load =
                          [&w](torch::serialize::InputArchive& a) {
                            at::Tensor got;
                            a.read("w", got);
                            w.copy_(got);
                          }};
}

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

// Review finding: the MIN agreement makes a half-recovered group recover
// again, which needs a member ahead of it. Here the up-to-date group dies
// right after the half recovery, and the lighthouse restarts (forgetting the
// newest step), so the next quorum is the half-recovered group alone, not
// behind. Before the fix its ranks trained on from different states; now
// every rank stops with a RendezvousError and commits nothing. Since the
// lighthouse failover the restarted lighthouse knows the newest step from
// the group's request and refuses the quorum; no holder comes within its
// join and heartbeat timeouts, and both ranks are told the state is lost
// (ReplicaStateLostError, rank 0's answer shared with rank 1).
TEST(FtReplicas, HalfRecoveredGroupWithNoPeerAheadStopsInsteadOfDiverging) {
  constexpr int kRanksPerGroup = 2;
  auto store = dist::Store::in_memory();
  const LighthouseOptions options{.min_replicas = 1,
                                  .heartbeat_timeout = milliseconds(500),
                                  .join_timeout = milliseconds(5000),
                                  .scan_interval = milliseconds(10)};
  auto lighthouse = std::make_unique<Lighthouse>(store, options);
  std::atomic<std::int64_t> b_step{0};
  std::atomic<bool> load_failed_once{false};
  std::atomic<bool> a_started{false};
  std::atomic<int> b_gone{0};
  std::vector<std::string> errors(4);
  std::vector<std::int64_t> commits_after_abort(4, 0);
  std::vector<at::Tensor> final_w(4);
  testing::run_rank_threads(4, [&](int rank, dist::Store) {
    const int replica = rank / kRanksPerGroup;
    const int local = rank % kRanksPerGroup;
    if (replica == 0) {
      while (b_step.load() < 2) std::this_thread::sleep_for(milliseconds(5));
    }
    auto group = dist::init_process_group(store.with_prefix("dgroup" + std::to_string(replica)), local, kRanksPerGroup,
                                          {.timeout = milliseconds(20000)});
    at::Tensor w = at::zeros({4});
    {
      LighthouseClient client(
          store, store,
          {.replica_id = replica, .quorum_timeout = milliseconds(20000), .commit_timeout = milliseconds(3000)});
      ReplicaState state{.save = [&](torch::serialize::OutputArchive& a) { a.write("w", w); },
                         .load =
                             [&](torch::serialize::InputArchive& a) {
                               if (replica == 0 && local == 1 && !load_failed_once.exchange(true)) {
                                 throw std::runtime_error("injected: loading the peer's state failed");
                               }
                               at::Tensor got;
                               a.read("w", got);
                               w.copy_(got);
                             }};
      FaultTolerantReplicas replicas(client, state, {.replica_group = group, .group_timeout = milliseconds(2000)});
      if (replica == 0) a_started = true;
      bool aborted = false;
      try {
        while (replicas.step() < 50) {
          replicas.start_step();
          if (replica == 1 && replicas.quorum().members.size() < 2) {
            if (replicas.step() >= 2) {
              while (!a_started.load()) std::this_thread::sleep_for(milliseconds(5));
              std::this_thread::sleep_for(milliseconds(200));
            } else {
              std::this_thread::sleep_for(milliseconds(20));
            }
          }
          std::vector<at::Tensor> grads{at::full({4}, static_cast<float>(replicas.step() + 1))};
          replicas.all_reduce_gradients(grads);
          const bool commit = replicas.should_commit();
          // Group 1 dies right after the step the half recovery aborted.
          if (replica == 1 && !commit) break;
          if (!commit) {
            aborted = true;
            continue;
          }
          if (aborted) ++commits_after_abort[rank];
          w -= grads[0];
          if (replica == 1 && local == 0) b_step = replicas.step();
        }
      } catch (const RendezvousError& e) {
        errors[rank] = e.what();
      }
    }  // group 1's client goes: its heartbeat stops
    final_w[rank] = w;
    if (replica == 1 && ++b_gone == kRanksPerGroup) {
      // The lighthouse restarts (on the same store) and forgets the newest step.
      lighthouse.reset();
      lighthouse = std::make_unique<Lighthouse>(store, options);
    }
  });
  EXPECT_TRUE(load_failed_once.load());
  for (int rank = 0; rank < 2; ++rank) {
    // The restarted lighthouse knows the newest step from the group's
    // request (its last quorum's: Note [Lighthouse failover]) and refuses
    // the quorum; once no holder came, both ranks are told the state is lost.
    EXPECT_NE(errors[rank].find("no up-to-date replica group is left"), std::string::npos)
        << "rank " << rank << ": '" << errors[rank] << "'";
    EXPECT_EQ(commits_after_abort[rank], 0) << "rank " << rank << " trained on";
  }
  // What the error prevents: rank 0 holds the peer's state, rank 1 its own.
  EXPECT_TRUE(at::equal(final_w[0], final_w[2]));
  EXPECT_TRUE(at::equal(final_w[1], at::zeros({4})));
}

// The chaos soak's finding (b): a member counted into a quorum (its request
// was there) that dies before the quorum's new group is made held every
// other member in the group's rendezvous for the group timeout (10.1 s in
// the soak, a kill during a recovery). Now the others notice its heartbeat
// stopped (the lighthouse's heartbeat timeout), abort that step and commit
// the next without it, long before the group timeout.
TEST(FtReplicas, MemberThatDiesAfterAskingFailsTheStepWithinTheHeartbeatTimeout) {
  auto store = dist::Store::in_memory();
  Lighthouse lighthouse(store, three_replicas_quick_heartbeats());
  constexpr auto kGroupTimeout = milliseconds(8000);
  std::vector<double> first_commit_s(2, -1);
  std::vector<std::string> first_members(2);
  std::vector<int> aborted(2, 0);
  const auto t0 = std::chrono::steady_clock::now();
  testing::run_rank_threads(3, [&](int rank, dist::Store) {
    if (rank == 2) {
      // Asks, is counted into the first quorum, and dies before making its group.
      LighthouseClient doomed(store, store, {.replica_id = 2});
      doomed.quorum(0);
      return;
    }
    LighthouseClient client(store, store, {.replica_id = rank, .commit_timeout = milliseconds(3000)});
    at::Tensor w = at::zeros({2});
    FaultTolerantReplicas replicas(client, state_of(w), {.group_timeout = kGroupTimeout});
    step_until(replicas, 2, aborted[rank], [&] {
      if (first_commit_s[rank] < 0) {
        first_commit_s[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        for (const auto& m : replicas.quorum().members) first_members[rank] += std::to_string(m.replica_id);
      }
    });
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(aborted[rank], 1) << "rank " << rank << ": the step with the dead member aborts, once";
    EXPECT_EQ(first_members[rank], "01") << "rank " << rank;
    EXPECT_GT(first_commit_s[rank], 0.0) << "rank " << rank;
    EXPECT_LT(first_commit_s[rank], 4.0) << "rank " << rank << " waited for the group timeout ("
                                         << kGroupTimeout.count() << " ms), not the heartbeat's";
  }
  lighthouse.check();
}

// The chaos soak's link cut (two nodes in network namespaces): a member whose
// link is cut after its group was made neither fails nor finishes the
// gradient all-reduce, and the others stood in it for the group timeout.
// Here member 2 commits step 0 with the others, joins step 1's quorum (the
// same group) and then goes silent (its heartbeat stops, its group stays
// open, it never enters the all-reduce), as behind a cut link. The others
// fail that all-reduce once its heartbeat has stopped for the lighthouse's
// heartbeat timeout, abort the step and commit the next without it, long
// before the group timeout (Note [Collectives on a silent member]).
TEST(FtReplicas, AllReduceOnASilentMemberFailsWithinTheHeartbeatTimeout) {
  auto store = dist::Store::in_memory();
  Lighthouse lighthouse(store, three_replicas_quick_heartbeats());
  constexpr auto kGroupTimeout = milliseconds(6000);  // the abandoned all-reduce ends then: the test's length
  std::vector<double> back_s(2, -1);                  // from the silence to the first commit after the abort
  std::vector<std::string> members_before(2), members_after(2);
  std::vector<int> aborted(2, 0);
  std::atomic<int> finished{0};
  std::atomic<std::int64_t> silent_at_ns{0};
  auto now_ns = [] { return std::chrono::steady_clock::now().time_since_epoch().count(); };
  auto ids = [](const Quorum& q) {
    std::string out;
    for (const auto& m : q.members) out += std::to_string(m.replica_id);
    return out;
  };
  testing::run_rank_threads(3, [&](int rank, dist::Store) {
    at::Tensor w = at::zeros({2});
    if (rank == 2) {
      auto client = std::make_unique<LighthouseClient>(store, store, LighthouseClientOptions{.replica_id = 2});
      auto silent = std::make_unique<FaultTolerantReplicas>(*client, state_of(w),
                                                            FaultTolerantOptions{.group_timeout = kGroupTimeout});
      silent->start_step();
      std::vector<at::Tensor> grads{at::ones({2})};
      silent->all_reduce_gradients(grads);
      EXPECT_TRUE(silent->should_commit());
      silent->start_step();  // step 1's quorum, the same group
      silent_at_ns = now_ns();
      client.reset();  // its heartbeat stops; the group stays open and never reduces
      const auto until = std::chrono::steady_clock::now() + kGroupTimeout + std::chrono::seconds(5);
      while (finished.load() < 2 && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(milliseconds(20));
      }
      silent.reset();  // only now its group closes (the others' abandoned all-reduce then ends)
      return;
    }
    LighthouseClient client(store, store, {.replica_id = rank, .commit_timeout = milliseconds(3000)});
    FaultTolerantReplicas replicas(client, state_of(w), {.group_timeout = kGroupTimeout});
    step_until(replicas, 3, aborted[rank], [&] {
      if (replicas.step() == 1) {
        members_before[rank] = ids(replicas.quorum());
      } else if (aborted[rank] > 0 && back_s[rank] < 0) {
        back_s[rank] = static_cast<double>(now_ns() - silent_at_ns.load()) * 1e-9;
        members_after[rank] = ids(replicas.quorum());
      }
    });
    ++finished;
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(members_before[rank], "012") << "rank " << rank;
    EXPECT_EQ(aborted[rank], 1) << "rank " << rank << ": the step with the silent member aborts, once";
    EXPECT_EQ(members_after[rank], "01") << "rank " << rank;
    EXPECT_GT(back_s[rank], 0.0) << "rank " << rank;
    EXPECT_LT(back_s[rank], 4.0) << "rank " << rank << " waited for the group timeout (" << kGroupTimeout.count()
                                 << " ms), not the heartbeat's";
  }
  lighthouse.check();
}

}  // namespace
}  // namespace dtrain::ft
