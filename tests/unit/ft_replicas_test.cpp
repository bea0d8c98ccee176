// FaultTolerantReplicas with replica groups of two ranks, as threads over an
// in-memory store (issue 27, review defect a): a recovery that completes on
// one rank of a group and fails on the other must not leave the group's
// ranks at different steps. The group agrees on its step (the minimum over
// its ranks) before it asks for a quorum, so both ranks recover again.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/serialize/archive.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
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

// A lighthouse that forms a quorum of whoever asks, with a 1 s heartbeat
// timeout: the live-recovery tests' (a restarted replica rejoins well within it).
LighthouseOptions any_replicas_one_second_heartbeats() {
  return {.min_replicas = 1,
          .heartbeat_timeout = milliseconds(1000),
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
  Lighthouse lighthouse(store, any_replicas_one_second_heartbeats());
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

// Live recovery in chunks (Note [Live recovery]): a state of many chunks
// (a prime chunk size, so the last one is short) and one of a single chunk,
// over shared memory and Gloo. Replica 1 joins behind at step 3 and must
// load replica 0's state bit for bit; both then train to the end, where each
// equals the same steps applied in this thread.
TEST(FtReplicas, RecoveryInManyChunksIsExact) {
  constexpr int kSteps = 6;
  constexpr std::int64_t kJoinAt = 3;
  auto step_state = [](at::Tensor& w, at::Tensor& m, std::int64_t step) {
    const double g = static_cast<double>(step + 1) / 7.0;
    m.mul_(0.9).add_(g);
    w.sub_(at::full_like(w, static_cast<float>(g)) * 0.01f);
  };
  auto initial = [] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(27);
    return std::pair{at::randn({100003}, gen), at::randn({33331}, gen, at::kDouble)};
  };
  for (const bool shared_memory : {true, false}) {
    for (const std::int64_t chunk : {std::int64_t{4093}, std::int64_t{1} << 20}) {
      SCOPED_TRACE(std::string(shared_memory ? "shared memory" : "gloo") + ", chunks of " + std::to_string(chunk));
      auto store = dist::Store::in_memory();
      Lighthouse lighthouse(store, any_replicas_one_second_heartbeats());
      std::atomic<std::int64_t> a_step{0};
      std::atomic<bool> b_started{false};
      std::vector<at::Tensor> final_w(2), final_m(2), loaded_w(2), source_w_at_join(2);
      std::vector<int> recoveries(2, 0);
      testing::run_rank_threads(2, [&](int replica, dist::Store) {
        if (replica == 1) {
          while (a_step.load() < kJoinAt) std::this_thread::sleep_for(milliseconds(5));
        }
        LighthouseClient client(store, store, {.replica_id = replica, .commit_timeout = milliseconds(3000)});
        auto [w, m] = initial();
        if (replica == 1) {
          w.fill_(7.0f);  // its own (stale) state, overwritten by the recovery
          m.zero_();
        }
        ReplicaState state{.save =
                               [&](torch::serialize::OutputArchive& a) {
                                 a.write("w", w);
                                 a.write("m", m);
                               },
                           .load =
                               [&](torch::serialize::InputArchive& a) {
                                 at::Tensor got_w, got_m;
                                 a.read("w", got_w);
                                 a.read("m", got_m);
                                 w.copy_(got_w);
                                 m.copy_(got_m);
                               }};
        FaultTolerantReplicas replicas(client, state,
                                       {.group_timeout = milliseconds(5000),
                                        .intra_host_shared_memory = shared_memory,
                                        .recovery_chunk_bytes = chunk});
        if (replica == 1) b_started = true;
        while (replicas.step() < kSteps) {
          replicas.start_step();
          if (replicas.recovered()) {
            ++recoveries[replica];
            loaded_w[replica] = w.clone();
          }
          if (replica == 0 && replicas.quorum().members.size() < 2) {
            if (replicas.step() >= kJoinAt) {
              // Alone at the join step: wait for replica 1 to ask.
              while (!b_started.load()) std::this_thread::sleep_for(milliseconds(5));
              std::this_thread::sleep_for(milliseconds(200));
            }
          }
          if (replica == 0 && !replicas.quorum().behind().empty()) source_w_at_join[0] = w.clone();
          std::vector<at::Tensor> grads{at::ones({2})};
          replicas.all_reduce_gradients(grads);
          if (!replicas.should_commit()) {
            continue;
          }
          step_state(w, m, replicas.step() - 1);
          if (replica == 0) a_step = replicas.step();
        }
        final_w[replica] = w;
        final_m[replica] = m;
      });
      auto [ref_w, ref_m] = initial();
      for (std::int64_t step = 0; step < kSteps; ++step) {
        step_state(ref_w, ref_m, step);
      }
      EXPECT_EQ(recoveries[0], 0);
      EXPECT_EQ(recoveries[1], 1);
      ASSERT_TRUE(loaded_w[1].defined());
      EXPECT_TRUE(at::equal(loaded_w[1], source_w_at_join[0])) << "the recovered state is not the source's";
      for (int replica = 0; replica < 2; ++replica) {
        EXPECT_TRUE(at::equal(final_w[replica], ref_w)) << "replica " << replica;
        EXPECT_TRUE(at::equal(final_m[replica], ref_m)) << "replica " << replica;
      }
      lighthouse.check();
    }
  }
}

// Note [Quorum read at the all-reduce]: replica 0 trains alone with
// overlap_quorum (its start_step() does not wait for the quorum asked ahead);
// replica 1 joins behind. The answer replica 0 reads at its all-reduce then
// has a new group and a member behind: that step's gradients are dropped,
// should_commit() is false with no failure, and the step runs again in the
// new group, where replica 0 serves replica 1's recovery. Every step commits
// once on replica 0, and both end where the recorded membership, applied in
// this thread (the mean summed in replica order, then divided), ends.
TEST(FtReplicas, QuorumReadAtTheAllReduceRunsTheStepAgainInANewGroup) {
  constexpr int kSteps = 8;
  constexpr std::int64_t kJoinAt = 3;
  auto gradient = [](int replica, std::int64_t step) {
    return at::full({5}, static_cast<float>((replica + 1) * (step + 1)) / 7.0f);
  };
  auto apply = [](at::Tensor& w, const at::Tensor& mean) { w.sub_(mean * 0.01f); };
  auto store = dist::Store::in_memory();
  Lighthouse lighthouse(store, any_replicas_one_second_heartbeats());
  std::atomic<bool> b_started{false};
  std::vector<at::Tensor> final_w(2);
  std::vector<int> members_of_step;  // replica 0's, per committed step
  std::vector<int> redone(2, 0), failed(2, 0), recoveries(2, 0), commits(2, 0);
  testing::run_rank_threads(2, [&](int replica, dist::Store) {
    if (replica == 1) {
      // Once step kJoinAt's quorum (replica 0's request asked ahead at its
      // commit of step kJoinAt - 1) has been formed without replica 1: had
      // replica 1 registered before the lighthouse answered that request,
      // step kJoinAt would already have had both.
      const auto formed = [&] {
        for (const auto& q : lighthouse.history()) {
          if (q.max_step() == kJoinAt) return true;
        }
        return false;
      };
      while (!formed()) std::this_thread::sleep_for(milliseconds(5));
    }
    LighthouseClient client(store, store, {.replica_id = replica, .commit_timeout = milliseconds(3000)});
    at::Tensor w = at::zeros({5});
    if (replica == 1) w.fill_(7.0f);  // overwritten by the recovery
    FaultTolerantReplicas replicas(client, state_of(w),
                                   {.group_timeout = milliseconds(5000), .max_steps = kSteps, .overlap_quorum = true});
    if (replica == 1) b_started = true;
    bool waited = false;
    while (replicas.step() < kSteps) {
      replicas.start_step();
      if (replicas.recovered()) ++recoveries[replica];
      if (replica == 0 && replicas.step() >= kJoinAt && !waited) {
        // Its next request (asked at this step's commit) meets replica 1's.
        while (!b_started.load()) std::this_thread::sleep_for(milliseconds(5));
        std::this_thread::sleep_for(milliseconds(200));
        waited = true;
      }
      std::vector<at::Tensor> grads{gradient(replica, replicas.step())};
      replicas.all_reduce_gradients(grads);
      if (!replicas.should_commit()) {
        ++(replicas.failure().empty() ? redone : failed)[replica];
        continue;
      }
      ++commits[replica];
      apply(w, grads[0]);
      if (replica == 0) {
        members_of_step.push_back(static_cast<int>(replicas.quorum().members.size()));
      }
    }
    final_w[replica] = w;
  });
  EXPECT_EQ(redone[0], 1) << "the step whose answer named the new group runs again, once";
  EXPECT_EQ(failed[0], 0);
  EXPECT_EQ(failed[1], 0);
  EXPECT_EQ(commits[0], kSteps) << "every step commits once on replica 0";
  EXPECT_EQ(recoveries[1], 1);
  ASSERT_EQ(members_of_step.size(), static_cast<std::size_t>(kSteps));
  at::Tensor ref = at::zeros({5});
  for (std::int64_t step = 0; step < kSteps; ++step) {
    const int members = members_of_step[static_cast<std::size_t>(step)];
    EXPECT_EQ(members, step <= kJoinAt ? 1 : 2) << "step " << step;
    at::Tensor mean = gradient(0, step);
    if (members == 2) mean = (mean + gradient(1, step)).div_(2);
    apply(ref, mean);
  }
  for (int replica = 0; replica < 2; ++replica) {
    EXPECT_TRUE(at::equal(final_w[replica], ref)) << "replica " << replica;
  }
  lighthouse.check();
}

// FaultTolerantOptions::max_retries (as torchft's Manager): replica 1
// reaches the lighthouse and votes, but in some steps never enters the
// gradient all-reduce (a hung member), so replica 0's all-reduce fails at the
// group timeout and every member's step aborts. With max_retries 2, the
// pattern commit, hang, hang, commit, hang, hang, hang stops both replicas
// at the seventh try, the third abort in a row (the commit in between reset
// the count; without the reset they would stop at the fifth try, the third
// abort in all), with a CommunicationError that says how many and what
// failed last, and nothing of the aborted steps applied. A negative
// max_retries is refused.
TEST(FtReplicas, MaxRetriesStopsEveryMemberWhenStepsKeepAborting) {
  auto store = dist::Store::in_memory();
  Lighthouse lighthouse(store, {.min_replicas = 2,
                                .startup_replicas = 2,
                                .heartbeat_timeout = milliseconds(3000),
                                .join_timeout = milliseconds(5000),
                                .scan_interval = milliseconds(10)});
  constexpr auto kGroupTimeout = milliseconds(300);
  const std::vector<bool> enters{true, false, false, true, false, false, false};  // replica 1, per step tried
  std::vector<std::string> error(2);
  std::vector<std::int64_t> committed(2, 0), stopped_at(2, -1), tries(2, 0);
  std::vector<at::Tensor> weights(2);
  testing::run_rank_threads(2, [&](int rank, dist::Store) {
    at::Tensor w = at::zeros({2});
    LighthouseClient client(store, store, {.replica_id = rank});
    FaultTolerantReplicas replicas(client, state_of(w), {.group_timeout = kGroupTimeout, .max_retries = 2});
    try {
      for (std::size_t i = 0; i < enters.size() + 3; ++i) {
        ++tries[rank];
        replicas.start_step();
        std::vector<at::Tensor> grads{at::ones({2})};
        if (rank == 0 || enters.at(std::min(i, enters.size() - 1))) {
          replicas.all_reduce_gradients(grads);
        } else {
          std::this_thread::sleep_for(2 * kGroupTimeout);  // hung: never enters this step's all-reduce
        }
        if (replicas.should_commit()) {
          w.sub_(grads[0]);
          ++committed[rank];
        }
      }
    } catch (const CommunicationError& e) {
      error[rank] = e.what();
      stopped_at[rank] = replicas.step();
    }
    weights[rank] = w;
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(committed[rank], 2) << "rank " << rank;
    EXPECT_EQ(tries[rank], 7) << "rank " << rank << ": " << error[rank];
    EXPECT_EQ(stopped_at[rank], 2) << "rank " << rank << ": " << error[rank];
    EXPECT_NE(error[rank].find("3 steps in a row aborted"), std::string::npos) << error[rank];
    EXPECT_NE(error[rank].find("max_retries (2)"), std::string::npos) << error[rank];
    EXPECT_TRUE(weights[rank].equal(at::full({2}, -2.0))) << "rank " << rank << ": " << weights[rank];
  }
  // Replica 0 names its own failure (the all-reduce); replica 1, whose own
  // steps did not fail, the member that did.
  EXPECT_NE(error[0].find("all-reduce"), std::string::npos) << error[0];
  EXPECT_NE(error[1].find("another member of"), std::string::npos) << error[1];
  LighthouseClient client(store, store, {.replica_id = 0});
  at::Tensor w = at::zeros({2});
  EXPECT_THROW(FaultTolerantReplicas(client, state_of(w), {.max_retries = -1}), ConfigError);
}

TEST(FtReplicas, NonPositiveRecoveryChunkIsAConfigError) {
  auto store = dist::Store::in_memory();
  Lighthouse lighthouse(store, {.min_replicas = 1});
  LighthouseClient client(store, store, {.replica_id = 0});
  at::Tensor w = at::zeros({2});
  for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{-1}}) {
    try {
      FaultTolerantReplicas replicas(client, state_of(w), {.recovery_chunk_bytes = chunk});
      ADD_FAILURE() << "a chunk of " << chunk << " bytes was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("recovery_chunk_bytes is " + std::to_string(chunk)), std::string::npos)
          << e.what();
    }
  }
}

// A source that dies mid-transfer (Note [Live recovery]): replicas 0 and 1
// train; replica 2 joins behind; its source sends 24 MiB in 64 KiB chunks
// (more than the 4 MiB shared-memory ring holds, so most are still queued)
// and then goes: its group and client are destroyed, the queued chunks
// never come. The receiver's recovery fails with an error that names the
// source and the bytes received, its state is untouched, and at the next
// quorum it recovers from the surviving replica and trains on with it.
TEST(FtReplicas, SourceThatDiesMidTransferLeavesTheReceiverUntouched) {
  constexpr int kSteps = 5;
  auto store = dist::Store::in_memory();
  Lighthouse lighthouse(store, {.min_replicas = 1,
                                .startup_replicas = 2,  // replicas 0 and 1 start together
                                .heartbeat_timeout = milliseconds(300),
                                .join_timeout = milliseconds(5000),
                                .scan_interval = milliseconds(10)});
  constexpr std::int64_t kFloats = (24 << 20) / 4;
  std::atomic<std::int64_t> steps_done{0};
  std::atomic<bool> c_started{false};
  std::atomic<int> died{-1};
  std::atomic<bool> c_failed{false};
  std::atomic<bool> c_voted{false};
  std::string first_failure;
  at::Tensor w_after_failure;
  std::vector<at::Tensor> final_w(3);
  std::vector<std::int64_t> final_step(3, -1);
  int c_recoveries = 0;
  testing::run_rank_threads(3, [&](int replica, dist::Store) {
    if (replica == 2) {
      while (steps_done.load() < 2) std::this_thread::sleep_for(milliseconds(5));
    }
    auto client = std::make_unique<LighthouseClient>(
        store, store, LighthouseClientOptions{.replica_id = replica, .commit_timeout = milliseconds(3000)});
    at::Tensor w = replica == 2 ? at::full({kFloats}, 7.0f) : at::zeros({kFloats});
    auto replicas = std::make_unique<FaultTolerantReplicas>(
        *client, state_of(w),
        FaultTolerantOptions{.group_timeout = milliseconds(3000), .recovery_chunk_bytes = 64 << 10});
    if (replica == 2) c_started = true;
    while (replicas->step() < kSteps) {
      replicas->start_step();
      const Quorum& q = replicas->quorum();
      const int me = q.index_of(replica);
      bool serving = false;
      for (const int peer : q.behind()) {
        serving = serving || q.recovery_source(peer) == me;
      }
      if (serving && died.load() < 0) {
        died = replica;
        replicas.reset();  // its group goes: the chunks still queued are never sent
        client.reset();    // and its heartbeat stops
        return;
      }
      if (replica == 2 && !replicas->failure().empty() && first_failure.empty()) {
        first_failure = replicas->failure();
        w_after_failure = w.clone();
        c_failed = true;
      }
      if (replica == 2 && replicas->recovered()) ++c_recoveries;
      if (replica != 2 && q.members.size() < 3 && replicas->step() >= 2 && died.load() < 0) {
        while (!c_started.load()) std::this_thread::sleep_for(milliseconds(5));
        std::this_thread::sleep_for(milliseconds(200));  // replica 2 asks meanwhile
      }
      if (replica != 2 && q.members.size() < 2 && died.load() >= 0) {
        // Alone after the death: wait until the receiver's recovery failed
        // and its step aborted; it asks again meanwhile, and recovers from
        // this replica.
        while (!c_voted.load()) std::this_thread::sleep_for(milliseconds(5));
        std::this_thread::sleep_for(milliseconds(200));
      }
      std::vector<at::Tensor> grads{at::ones({2})};
      replicas->all_reduce_gradients(grads);
      if (!replicas->should_commit()) {
        if (replica == 2 && c_failed.load()) c_voted = true;
        continue;
      }
      w.add_(1.0f);
      if (replica != 2) steps_done = replicas->step();
    }
    final_w[replica] = w;
    final_step[replica] = replicas->step();
  });
  ASSERT_GE(died.load(), 0) << "no replica served a recovery";
  const int survivor = 1 - died.load();
  EXPECT_NE(first_failure.find("live recovery from replica " + std::to_string(died.load())), std::string::npos)
      << first_failure;
  EXPECT_NE(first_failure.find(" bytes received"), std::string::npos) << first_failure;
  EXPECT_EQ(first_failure.find("loading them failed"), std::string::npos) << "every byte arrived: " << first_failure;
  ASSERT_TRUE(w_after_failure.defined());
  EXPECT_TRUE(at::equal(w_after_failure, at::full({kFloats}, 7.0f))) << "the receiver's state changed";
  EXPECT_EQ(c_recoveries, 1) << "the receiver recovers again, from the survivor";
  EXPECT_EQ(final_step[2], kSteps);
  EXPECT_EQ(final_step[survivor], kSteps);
  EXPECT_TRUE(at::equal(final_w[2], final_w[survivor]));
  EXPECT_TRUE(at::equal(final_w[survivor], at::full({kFloats}, static_cast<float>(kSteps))));
}

// FaultTolerantOptions::gradients_as_buffer_views (Note [Gradients as views
// of the flat buffer]): two replicas, two gradients each. The mean comes back
// as views of one buffer, equal to the copy path's mean bit for bit, and the
// tensors passed in are left as they were (nothing is copied back). In the
// last step a replica keeps its previous step's views and accumulates into
// them (a caller that did not drop them): the step takes a fresh buffer, so
// the kept views still hold what they held, and its mean is still right.
TEST(FtReplicas, GradientsAsBufferViewsEqualTheCopiedMean) {
  constexpr int kSteps = 3;
  auto gradient = [](int replica, std::int64_t step, int which) {
    return at::full({which == 0 ? 3 : 2, 2}, static_cast<float>((replica + 1) * (step + 2) + which) / 7.0f);
  };
  auto store = dist::Store::in_memory();
  Lighthouse lighthouse(store, {.min_replicas = 2,
                                .startup_replicas = 2,
                                .heartbeat_timeout = milliseconds(1000),
                                .join_timeout = milliseconds(5000),
                                .scan_interval = milliseconds(10)});
  std::vector<int> commits(2, 0);
  testing::run_rank_threads(2, [&](int replica, dist::Store) {
    LighthouseClient client(store, store, {.replica_id = replica, .commit_timeout = milliseconds(3000)});
    at::Tensor w = at::zeros({1});
    FaultTolerantReplicas replicas(
        client, state_of(w),
        {.group_timeout = milliseconds(5000), .max_steps = kSteps, .gradients_as_buffer_views = true});
    std::vector<at::Tensor> kept;  // the last step's views
    while (replicas.step() < kSteps) {
      replicas.start_step();
      const std::int64_t step = replicas.step();
      std::vector<at::Tensor> given{gradient(replica, step, 0), gradient(replica, step, 1)};
      std::vector<at::Tensor> grads = given;
      at::Tensor kept_before;
      if (step == kSteps - 1 && replica == 1) {
        // Accumulated into the kept views: the same values as given.
        for (int i = 0; i < 2; ++i) kept[i].zero_().add_(given[i]);
        grads = kept;
        kept_before = at::cat({kept[0].reshape({-1}), kept[1].reshape({-1})});
      }
      replicas.all_reduce_gradients(grads);
      ASSERT_TRUE(replicas.should_commit()) << replicas.failure();
      ++commits[replica];
      for (int i = 0; i < 2; ++i) {
        const at::Tensor mean = (gradient(0, step, i) + gradient(1, step, i)).div_(2);
        EXPECT_TRUE(at::equal(grads[i], mean)) << "replica " << replica << ", step " << step << ", gradient " << i;
        EXPECT_TRUE(grads[i].is_alias_of(grads[0])) << "one buffer holds every mean";
        if (!kept_before.defined()) {
          EXPECT_FALSE(grads[i].is_alias_of(given[i])) << "a view, not the tensor passed in";
          EXPECT_TRUE(at::equal(given[i], gradient(replica, step, i))) << "nothing is copied back";
        }
      }
      if (kept_before.defined()) {
        EXPECT_FALSE(grads[0].is_alias_of(kept[0])) << "a kept view gets a fresh buffer";
        EXPECT_TRUE(at::equal(at::cat({kept[0].reshape({-1}), kept[1].reshape({-1})}), kept_before))
            << "the step wrote under a view the caller kept";
      }
      kept = grads;
    }
  });
  EXPECT_EQ(commits[0], kSteps);
  EXPECT_EQ(commits[1], kSteps);
  lighthouse.check();
}

}  // namespace
}  // namespace dtrain::ft
