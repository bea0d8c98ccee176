// Fault-tolerant replica groups end to end (issue 27): `dtrain run
// --ft-replicas 3` trains the MLP of ft_model.h as three replica groups of
// one rank (tests/system/ft_worker.cpp); the test SIGKILLs one mid-run.
// The other two never stop (one process each, throughout), the launcher
// restarts only the killed group, which recovers live from a peer (another
// initial seed, so its final state can only have come from the peer); every
// step commits once (no step repeated or skipped, each sample consumed at
// most once: the audit), and every replica's final parameters equal, bit
// for bit, a one-process replay that applies the same per-step membership.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <map>
#include <set>
#include <sstream>

#include "ft_model.h"
#include "launch_helpers.h"

namespace dtrain::testing {
namespace {

const std::string kFtWorker = std::string(DTRAIN_BINARY_DIR) + "/tests/dtrain_ft_worker";
// The same replica group trained by dtrain::Trainer (TrainerOptions::fault_tolerance).
const std::string kFtTrainerWorker = std::string(DTRAIN_BINARY_DIR) + "/tests/dtrain_ft_trainer_worker";

struct FtStepLine {
  std::int64_t step = 0;
  std::int64_t quorum = 0;
  std::vector<int> members;
  std::int64_t first_sample = 0;
  std::int64_t incarnation = 0;
  int pid = 0;
};

struct FtReplicaLog {
  std::vector<FtStepLine> steps;
  std::vector<std::pair<std::int64_t, int>> recovered;  // (step, pid) of each recovery
};

FtReplicaLog read_ft_log(const fs::path& path) {
  FtReplicaLog log;
  std::istringstream in(slurp(path));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind;
    words >> kind;
    if (kind == "recovered") {
      std::int64_t s = 0;
      int pid = 0;
      std::string w;
      words >> s >> w >> pid;
      log.recovered.emplace_back(s, pid);
      continue;
    }
    FtStepLine l;
    std::string w, members;
    words >> l.step >> w >> l.quorum >> w >> members >> w >> l.first_sample >> w >> l.incarnation >> w >> l.pid;
    std::istringstream m(members);
    std::string id;
    while (std::getline(m, id, ',')) l.members.push_back(std::stoi(id));
    log.steps.push_back(l);
  }
  return log;
}

std::size_t ft_steps_logged(const fs::path& path) {
  return read_ft_log(path).steps.size();
}

// `kReplicas` replica groups of `k` ranks; rank 0 of group kVictim is
// SIGKILLed after 20 steps (with k > 1 the launcher then stops its other
// ranks and restarts the whole group). `worker`: ft_worker.cpp's hand-written
// loop, or ft_trainer_worker.cpp's Trainer.
void run_ft_kill_scenario(const int kReplicas, const int k, const std::string& worker = kFtWorker) {
  constexpr int kSteps = 200;
  constexpr int kVictim = 1;
  Scratch scratch;
  const fs::path dir = scratch.path();
  ::setenv("FT_DIR", dir.c_str(), 1);
  ::setenv("FT_STEPS", std::to_string(kSteps).c_str(), 1);
  ::setenv("FT_STEP_MS", "15", 1);
  // The restarted group joins well after the heartbeat timeout, so the
  // survivors step on without it meanwhile.
  ::setenv("FT_RESTART_DELAY_MS", "2000", 1);
  Launch launch({"--nproc-per-node", std::to_string(kReplicas * k), "--ft-replicas", std::to_string(kReplicas),
                 "--max-restarts", "2", "--ft-heartbeat-timeout", "0.5", "--log-dir", (dir / "logs").string(), worker},
                scratch);
  const fs::path victim_log = dir / ("replica_" + std::to_string(kVictim) + ".log");
  ASSERT_TRUE(wait_for([&] { return ft_steps_logged(victim_log) >= 20; }, std::chrono::seconds(60))) << launch.err();
  const int victim_pid = read_ft_log(victim_log).steps.back().pid;
  ASSERT_EQ(::kill(victim_pid, SIGKILL), 0);
  ASSERT_EQ(launch.wait(std::chrono::seconds(120)), 0) << launch.err();
  EXPECT_NE(launch.err().find("restarting that replica group only"), std::string::npos) << launch.err();

  std::map<int, FtReplicaLog> logs;
  for (int r = 0; r < kReplicas; ++r) logs[r] = read_ft_log(dir / ("replica_" + std::to_string(r) + ".log"));

  // The survivors: one process throughout, every step once, in order.
  for (int r = 0; r < kReplicas; ++r) {
    if (r == kVictim) continue;
    const auto& steps = logs[r].steps;
    ASSERT_EQ(steps.size(), static_cast<std::size_t>(kSteps)) << "replica " << r;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(steps[s].step, s) << "replica " << r;
      EXPECT_EQ(steps[s].pid, steps.front().pid) << "replica " << r << " was restarted";
    }
    EXPECT_TRUE(logs[r].recovered.empty()) << "replica " << r;
  }
  // The victim: two incarnations; the second recovered live, past the
  // steps the first committed, and went on from there.
  const auto& victim = logs[kVictim];
  std::set<int> pids;
  for (const auto& l : victim.steps) pids.insert(l.pid);
  EXPECT_EQ(pids.size(), 2u);
  ASSERT_EQ(victim.recovered.size(), 1u);
  EXPECT_NE(victim.recovered[0].second, victim_pid);
  std::int64_t last_before_kill = -1;
  for (const auto& l : victim.steps) {
    if (l.pid == victim_pid) last_before_kill = l.step;
  }
  EXPECT_GT(victim.recovered[0].first, last_before_kill) << "the restarted group did not start where the others were";
  for (std::size_t i = 1; i < victim.steps.size(); ++i) {
    EXPECT_GT(victim.steps[i].step, victim.steps[i - 1].step) << "a step repeated";
    if (victim.steps[i].pid == victim.steps[i - 1].pid) {
      EXPECT_EQ(victim.steps[i].step, victim.steps[i - 1].step + 1);
    }
  }
  EXPECT_EQ(victim.steps.back().step, kSteps - 1);

  // One membership per step, agreed by every replica that logged it; a
  // member that did not log a step is the victim at the step it died in.
  std::vector<std::vector<int>> membership(kSteps);
  std::set<std::int64_t> samples;
  bool shrank = false;
  for (int s = 0; s < kSteps; ++s) {
    membership[s] = logs[0].steps[s].members;
    // The groups start together (the first quorum waits for all of them).
    if (s == 0) {
      EXPECT_EQ(membership[s].size(), static_cast<std::size_t>(kReplicas));
    }
    shrank = shrank || membership[s].size() < static_cast<std::size_t>(kReplicas);
    for (const int m : membership[s]) {
      const auto& ls = logs[m].steps;
      const auto it = std::find_if(ls.begin(), ls.end(), [s](const FtStepLine& l) { return l.step == s; });
      if (it == ls.end()) {
        EXPECT_EQ(m, kVictim) << "step " << s;
        continue;
      }
      EXPECT_EQ(it->members, membership[s]) << "replicas disagree on step " << s << "'s members";
      // The sample audit: each (step, replica) batch consumed once.
      EXPECT_TRUE(samples.insert(it->first_sample).second) << "samples of step " << s << " consumed twice";
      EXPECT_EQ(it->first_sample, ft_problem::first_sample(s, m * k));
    }
  }
  EXPECT_TRUE(shrank) << "no step ran without the killed replica group: the kill did not take it out";
  EXPECT_EQ(membership.back().size(), static_cast<std::size_t>(kReplicas)) << "the victim did not rejoin";

  // The replay: the same membership per step, gradients summed in replica
  // order and divided by the members (as the group's all-reduce does).
  at::set_num_threads(1);
  auto model = ft_problem::make_model(0);
  auto optimizer = ft_problem::make_optimizer(model);
  auto params = model->parameters();
  // A replica group's gradient: its ranks' summed in rank order, divided by k.
  auto replica_gradients = [&](std::int64_t s, int m) {
    std::vector<at::Tensor> g;
    for (int local = 0; local < k; ++local) {
      ft_problem::compute_gradients(model, s, m * k + local);
      for (std::size_t i = 0; i < params.size(); ++i) {
        if (local == 0) {
          g.push_back(params[i].grad().clone());
        } else {
          g[i].add_(params[i].grad());
        }
      }
    }
    if (k > 1) {
      for (auto& t : g) t.div_(k);
    }
    return g;
  };
  for (int s = 0; s < kSteps; ++s) {
    std::vector<at::Tensor> sum;
    for (const int m : membership[s]) {
      auto g = replica_gradients(s, m);
      for (std::size_t i = 0; i < params.size(); ++i) {
        if (sum.size() < params.size()) {
          sum.push_back(g[i]);
        } else {
          sum[i].add_(g[i]);
        }
      }
    }
    const auto n = static_cast<std::int64_t>(membership[s].size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (n > 1) sum[i].div_(n);
      params[i].mutable_grad() = sum[i];
    }
    optimizer.step();
  }
  for (int r = 0; r < kReplicas; ++r) {
    for (int local = 0; local < k; ++local) {
      std::vector<at::Tensor> final_params;
      torch::load(final_params, (dir / ("final_" + std::to_string(r) + "_" + std::to_string(local) + ".pt")).string());
      ASSERT_EQ(final_params.size(), params.size());
      for (std::size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::equal(final_params[i], params[i]))
            << "replica " << r << " rank " << local << " parameter " << i;
      }
    }
  }
}

TEST(FaultTolerance, KilledReplicaGroupRecoversLiveAndMatchesReplay) {
  run_ft_kill_scenario(/*replicas=*/3, /*ranks_per_replica=*/1);
}

// Two ranks per replica group, averaging among themselves first: each rank
// recovers from the same rank of a peer group.
TEST(FaultTolerance, KilledTwoRankReplicaGroupRecoversLiveAndMatchesReplay) {
  run_ft_kill_scenario(/*replicas=*/2, /*ranks_per_replica=*/2);
}

// The Trainer with TrainerOptions::fault_tolerance: three replica groups
// of one rank, one SIGKILLed; the same checks against the same replay (the
// scaler, schedule and step counter travel in its recovery).
TEST(FaultTolerance, TrainerKilledReplicaGroupRecoversLiveAndMatchesReplay) {
  run_ft_kill_scenario(/*replicas=*/3, /*ranks_per_replica=*/1, kFtTrainerWorker);
}

// Two ranks per replica group, a DdpStrategy inside each.
TEST(FaultTolerance, TrainerKilledDdpReplicaGroupRecoversLiveAndMatchesReplay) {
  run_ft_kill_scenario(/*replicas=*/2, /*ranks_per_replica=*/2, kFtTrainerWorker);
}

}  // namespace
}  // namespace dtrain::testing
