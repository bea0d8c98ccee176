// The audit of a fault-tolerance kill scenario (issue 27), shared by the
// MLP workers' tests (ft_test.cpp) and the GPT example's (gpt_ft_test.cpp):
// what each replica group logged per committed step (its quorum's members,
// the first sample it trained on, its process), and the checks that the
// survivors never stopped, the killed group came back past where it died and
// went on from a live peer's step, every step committed once with one
// membership agreed by its members, and each (step, replica) batch was
// consumed once. Returns the membership the replay applies.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace dtrain::testing {

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
  // (step, pid) of each recovery; nullopt where the worker does not log them.
  std::optional<std::vector<std::pair<std::int64_t, int>>> recovered;
};

struct FtKillAudit {
  int replicas = 0;
  int victim = 0;
  int victim_pid = 0;  // the process the test SIGKILLed
  int steps = 0;
  // The first sample replica group `replica` trains on at `step`.
  std::function<std::int64_t(std::int64_t step, int replica)> first_sample;
};

// ADD_FAILUREs for what is wrong; the per-step membership (empty when a
// survivor's log is short, which is reported).
inline std::vector<std::vector<int>> audit_ft_kill(const std::map<int, FtReplicaLog>& logs, const FtKillAudit& a) {
  // The survivors: one process throughout, every step once, in order.
  for (int r = 0; r < a.replicas; ++r) {
    if (r == a.victim) continue;
    const auto& steps = logs.at(r).steps;
    EXPECT_EQ(steps.size(), static_cast<std::size_t>(a.steps)) << "replica " << r;
    if (steps.size() != static_cast<std::size_t>(a.steps)) return {};
    for (int s = 0; s < a.steps; ++s) {
      EXPECT_EQ(steps[s].step, s) << "replica " << r;
      EXPECT_EQ(steps[s].pid, steps.front().pid) << "replica " << r << " was restarted";
    }
    if (logs.at(r).recovered) {
      EXPECT_TRUE(logs.at(r).recovered->empty()) << "replica " << r;
    }
  }
  // The victim: two incarnations; the second recovered live, past the
  // steps the first committed, and went on from there.
  const auto& victim = logs.at(a.victim);
  std::set<int> pids;
  for (const auto& l : victim.steps) pids.insert(l.pid);
  EXPECT_EQ(pids.size(), 2u);
  std::int64_t last_before_kill = -1;
  std::optional<std::int64_t> first_after_kill;
  for (const auto& l : victim.steps) {
    if (l.pid == a.victim_pid) last_before_kill = l.step;
    if (l.pid != a.victim_pid && !first_after_kill) first_after_kill = l.step;
  }
  if (victim.recovered) {
    EXPECT_EQ(victim.recovered->size(), 1u);
    if (victim.recovered->size() == 1) {
      EXPECT_NE(victim.recovered->front().second, a.victim_pid);
      EXPECT_GT(victim.recovered->front().first, last_before_kill)
          << "the restarted group did not start where the others were";
    }
  } else {
    // No recovery log: a restarted group that did not recover would start
    // again from step 0.
    EXPECT_TRUE(first_after_kill && *first_after_kill > last_before_kill)
        << "the restarted group did not start where the others were";
  }
  for (std::size_t i = 1; i < victim.steps.size(); ++i) {
    EXPECT_GT(victim.steps[i].step, victim.steps[i - 1].step) << "a step repeated";
    if (victim.steps[i].pid == victim.steps[i - 1].pid) {
      EXPECT_EQ(victim.steps[i].step, victim.steps[i - 1].step + 1);
    }
  }
  EXPECT_FALSE(victim.steps.empty());
  if (!victim.steps.empty()) {
    EXPECT_EQ(victim.steps.back().step, a.steps - 1);
  }

  // One membership per step, agreed by every replica that logged it; a
  // member that did not log a step is the victim at the step it died in.
  const int reference = a.victim == 0 ? 1 : 0;
  std::vector<std::vector<int>> membership(a.steps);
  std::set<std::int64_t> samples;
  bool shrank = false;
  for (int s = 0; s < a.steps; ++s) {
    membership[s] = logs.at(reference).steps[s].members;
    // The groups start together (the first quorum waits for all of them).
    if (s == 0) {
      EXPECT_EQ(membership[s].size(), static_cast<std::size_t>(a.replicas));
    }
    shrank = shrank || membership[s].size() < static_cast<std::size_t>(a.replicas);
    for (const int m : membership[s]) {
      const auto& ls = logs.at(m).steps;
      const auto it = std::find_if(ls.begin(), ls.end(), [s](const FtStepLine& l) { return l.step == s; });
      if (it == ls.end()) {
        EXPECT_EQ(m, a.victim) << "step " << s;
        continue;
      }
      EXPECT_EQ(it->members, membership[s]) << "replicas disagree on step " << s << "'s members";
      // The sample audit: each (step, replica) batch consumed once.
      EXPECT_TRUE(samples.insert(it->first_sample).second) << "samples of step " << s << " consumed twice";
      EXPECT_EQ(it->first_sample, a.first_sample(s, m));
    }
  }
  EXPECT_TRUE(shrank) << "no step ran without the killed replica group: the kill did not take it out";
  EXPECT_EQ(membership.back().size(), static_cast<std::size_t>(a.replicas)) << "the victim did not rejoin";
  return membership;
}

}  // namespace dtrain::testing
