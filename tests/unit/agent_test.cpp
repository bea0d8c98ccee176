// The launcher agent's state machine, driven by a scripted fake WorkerGroup.
#include <gtest/gtest.h>
#include <signal.h>

#include <deque>
#include <set>

#include "dtrain/elastic/agent.h"

using namespace dtrain::elastic;

namespace {
// Each round plays one scripted outcome: succeed, or fail with `failure`.
class FakeWorkers : public WorkerGroup {
 public:
  struct Round {
    GroupStatus end = GroupStatus::kSucceeded;
    WorkerExit failure;
    int polls_before_end = 2;
  };
  std::deque<Round> rounds;
  std::vector<std::vector<WorkerLaunch>> started;
  std::vector<int> stop_signals;

  void start(const std::vector<WorkerLaunch>& workers, int attempt) override {
    started.push_back(workers);
    EXPECT_EQ(attempt, static_cast<int>(started.size()) - 1);
    current_ = rounds.front();
    rounds.pop_front();
  }
  GroupStatus poll(std::chrono::milliseconds, std::optional<WorkerExit>& failure) override {
    if (current_.polls_before_end-- > 0) return GroupStatus::kRunning;
    if (current_.end == GroupStatus::kFailed) failure = current_.failure;
    return current_.end;
  }
  void stop(int signal, std::chrono::milliseconds) override { stop_signals.push_back(signal); }

 private:
  Round current_;
};

WorkerExit failed_rank(int rank, int code, int signal = 0) {
  return WorkerExit{.local_rank = rank, .global_rank = rank, .exit_code = code, .signal = signal};
}

}  // namespace

TEST(Agent, RestartsAfterFailuresThenSucceeds) {
  FakeWorkers workers;
  workers.rounds = {{GroupStatus::kFailed, failed_rank(1, 3)}, {GroupStatus::kFailed, failed_rank(0, 0, SIGKILL)}, {}};
  Agent agent({.nproc_per_node = 2, .max_restarts = 2, .monitor_interval = std::chrono::milliseconds(1)}, workers);
  std::vector<AgentState> states;
  agent.on_transition = [&](AgentState, AgentState to) { states.push_back(to); };
  std::atomic<int> interrupt{0};
  const auto result = agent.run(interrupt);
  EXPECT_EQ(result.state, AgentState::kSucceeded);
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_EQ(result.restarts, 2);
  EXPECT_EQ(states, (std::vector<AgentState>{AgentState::kRendezvous, AgentState::kRunning, AgentState::kRestarting,
                                             AgentState::kRendezvous, AgentState::kRunning, AgentState::kRestarting,
                                             AgentState::kRendezvous, AgentState::kRunning, AgentState::kSucceeded}));
  ASSERT_EQ(workers.started.size(), 3u);
  // Each round: the contract, the restart count, a fresh port handed to rank 0 only.
  std::set<std::string> ports;
  for (size_t round = 0; round < 3; ++round) {
    const auto& launch = workers.started[round];
    ASSERT_EQ(launch.size(), 2u);
    EXPECT_EQ(launch[1].env.at("RANK"), "1");
    EXPECT_EQ(launch[1].env.at("WORLD_SIZE"), "2");
    EXPECT_EQ(launch[1].env.at("TORCHELASTIC_RESTART_COUNT"), std::to_string(round));
    EXPECT_EQ(launch[1].env.at("TORCHELASTIC_MAX_RESTARTS"), "2");
    EXPECT_TRUE(launch[0].env.count("DTRAIN_MASTER_LISTEN_FD"));
    EXPECT_FALSE(launch[1].env.count("DTRAIN_MASTER_LISTEN_FD"));
    EXPECT_GE(launch[0].inherit_fd, 0);
    EXPECT_EQ(launch[1].inherit_fd, -1);
    EXPECT_EQ(launch[0].env.at("MASTER_PORT"), launch[1].env.at("MASTER_PORT"));
    ports.insert(launch[0].env.at("MASTER_PORT"));
  }
  EXPECT_EQ(ports.size(), 3u) << "rounds must not reuse a port";
  EXPECT_EQ(workers.stop_signals, (std::vector<int>{SIGTERM, SIGTERM}));
}

TEST(Agent, NoRestartsLeftReportsTheRootCause) {
  FakeWorkers workers;
  workers.rounds = {{GroupStatus::kFailed, failed_rank(1, 3)}, {GroupStatus::kFailed, failed_rank(0, 0, SIGSEGV)}};
  Agent agent({.nproc_per_node = 2, .max_restarts = 1, .monitor_interval = std::chrono::milliseconds(1)}, workers);
  std::atomic<int> interrupt{0};
  const auto result = agent.run(interrupt);
  EXPECT_EQ(result.state, AgentState::kFailed);
  EXPECT_EQ(result.exit_code, 128 + SIGSEGV);
  EXPECT_EQ(result.restarts, 1);
  ASSERT_TRUE(result.root_cause.has_value());
  EXPECT_EQ(result.root_cause->describe(), "rank 0 (local rank 0) was killed by SIGSEGV");
}

TEST(Agent, InterruptIsForwardedAndEndsTheRun) {
  FakeWorkers workers;
  workers.rounds = {{.polls_before_end = 1000000}};
  Agent agent({.nproc_per_node = 1, .monitor_interval = std::chrono::milliseconds(1)}, workers);
  std::atomic<int> interrupt{SIGINT};
  const auto result = agent.run(interrupt);
  EXPECT_EQ(result.state, AgentState::kInterrupted);
  EXPECT_EQ(result.exit_code, 128 + SIGINT);
  EXPECT_EQ(workers.stop_signals, std::vector<int>{SIGINT});
}

TEST(Agent, HungWorkerExitCodeAndDescription) {
  WorkerExit hung{.local_rank = 2, .global_rank = 5, .hung = true};
  EXPECT_EQ(hung.launcher_exit_code(), 124);
  EXPECT_EQ(hung.describe(), "rank 5 (local rank 2) stopped responding and was killed");
  WorkerExit with_error{.global_rank = 1, .exit_code = 7, .error = "boom"};
  EXPECT_EQ(with_error.describe(), "rank 1 (local rank 0) exited with code 7: boom");
}
