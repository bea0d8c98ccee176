// The launcher agent's state machine, driven by a scripted fake WorkerGroup
// and a fake host of the workers' store.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <deque>
#include <filesystem>
#include <set>

#include "dtrain/elastic/agent.h"
#include "dtrain/elastic/replica_agent.h"
#include "dtrain/error.h"

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

// Records what it is asked to serve; closes the sockets it is given on stop().
class FakeStoreHost : public WorkerStoreHost {
 public:
  struct Served {
    int port = 0;
    bool listening = false;  // the socket was listening when handed over
  };
  std::vector<Served> served;
  int stops_while_serving = 0;
  std::optional<std::string> fail_with;  // check() throws this
  // A lighthouse that found every up-to-date replica group gone: check()
  // throws ReplicaStateLostError after this many checks (-1: never), until
  // served again (a fresh lighthouse).
  int lost_after_checks = -1;

  ~FakeStoreHost() override { stop(); }
  void serve(int listen_fd, int port) override {
    int accepting = 0;
    socklen_t len = sizeof accepting;
    ::getsockopt(listen_fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len);
    served.push_back({.port = port, .listening = accepting != 0});
    fd_ = listen_fd;
    if (served.size() > 1) lost_after_checks = -1;
  }
  void stop() override {
    if (fd_ < 0) return;
    ::close(fd_);
    fd_ = -1;
    ++stops_while_serving;
  }
  void check() override {
    if (fail_with) throw dtrain::ConfigError(*fail_with, "fix it");
    if (lost_after_checks == 0) throw dtrain::ReplicaStateLostError("every up-to-date group is gone", "test");
    if (lost_after_checks > 0) --lost_after_checks;
  }

 private:
  int fd_ = -1;
};

WorkerExit failed_rank(int rank, int code, int signal = 0) {
  return WorkerExit{.local_rank = rank, .global_rank = rank, .exit_code = code, .signal = signal};
}

}  // namespace

TEST(Agent, RestartsAfterFailuresThenSucceeds) {
  FakeWorkers workers;
  workers.rounds = {{GroupStatus::kFailed, failed_rank(1, 3)}, {GroupStatus::kFailed, failed_rank(0, 0, SIGKILL)}, {}};
  FakeStoreHost store;
  Agent agent({.nproc_per_node = 2, .max_restarts = 2, .monitor_interval = std::chrono::milliseconds(1)}, workers,
              store);
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
  // Each round: the contract, the restart count, a fresh port on which the
  // agent serves the store, and every worker told so.
  ASSERT_EQ(store.served.size(), 3u);
  EXPECT_EQ(store.stops_while_serving, 3);  // after each round, the last one at the end of the run
  std::set<std::string> ports;
  for (size_t round = 0; round < 3; ++round) {
    const auto& launch = workers.started[round];
    ASSERT_EQ(launch.size(), 2u);
    EXPECT_EQ(launch[1].env.at("RANK"), "1");
    EXPECT_EQ(launch[1].env.at("WORLD_SIZE"), "2");
    EXPECT_EQ(launch[1].env.at("TORCHELASTIC_RESTART_COUNT"), std::to_string(round));
    EXPECT_EQ(launch[1].env.at("TORCHELASTIC_MAX_RESTARTS"), "2");
    for (const auto& w : launch) EXPECT_EQ(w.env.at("TORCHELASTIC_USE_AGENT_STORE"), "True");
    EXPECT_EQ(launch[0].env.at("MASTER_PORT"), launch[1].env.at("MASTER_PORT"));
    EXPECT_EQ(launch[0].env.at("MASTER_PORT"), std::to_string(store.served[round].port));
    EXPECT_TRUE(store.served[round].listening) << "workers may connect before the store accepts";
    ports.insert(launch[0].env.at("MASTER_PORT"));
  }
  EXPECT_EQ(ports.size(), 3u) << "rounds must not reuse a port";
  EXPECT_EQ(workers.stop_signals, (std::vector<int>{SIGTERM, SIGTERM}));
}

TEST(Agent, NoRestartsLeftReportsTheRootCause) {
  FakeWorkers workers;
  workers.rounds = {{GroupStatus::kFailed, failed_rank(1, 3)}, {GroupStatus::kFailed, failed_rank(0, 0, SIGSEGV)}};
  FakeStoreHost store;
  Agent agent({.nproc_per_node = 2, .max_restarts = 1, .monitor_interval = std::chrono::milliseconds(1)}, workers,
              store);
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
  FakeStoreHost store;
  Agent agent({.nproc_per_node = 1, .monitor_interval = std::chrono::milliseconds(1)}, workers, store);
  std::atomic<int> interrupt{SIGINT};
  const auto result = agent.run(interrupt);
  EXPECT_EQ(result.state, AgentState::kInterrupted);
  EXPECT_EQ(result.exit_code, 128 + SIGINT);
  EXPECT_EQ(workers.stop_signals, std::vector<int>{SIGINT});
  EXPECT_EQ(store.stops_while_serving, 1);
}

TEST(Agent, StoreThatCannotServeStopsTheWorkersWithItsError) {
  FakeWorkers workers;
  workers.rounds = {{.polls_before_end = 1000000}};
  FakeStoreHost store;
  store.fail_with = "cannot load libdtrain";
  Agent agent({.nproc_per_node = 2, .monitor_interval = std::chrono::milliseconds(1)}, workers, store);
  std::atomic<int> interrupt{0};
  try {
    agent.run(interrupt);
    ADD_FAILURE() << "expected the store's error";
  } catch (const dtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot load libdtrain"), std::string::npos) << e.what();
  }
  EXPECT_EQ(workers.stop_signals, std::vector<int>{SIGTERM});
  EXPECT_EQ(store.stops_while_serving, 1);
}

TEST(Agent, HungWorkerExitCodeAndDescription) {
  WorkerExit hung{.local_rank = 2, .global_rank = 5, .hung = true};
  EXPECT_EQ(hung.launcher_exit_code(), 124);
  EXPECT_EQ(hung.describe(), "rank 5 (local rank 2) stopped responding and was killed");
  WorkerExit with_error{.global_rank = 1, .exit_code = 7, .error = "boom"};
  EXPECT_EQ(with_error.describe(), "rank 1 (local rank 0) exited with code 7: boom");
}

namespace {
int open_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}
}  // namespace

// --ft-replicas (issue 27): each replica group, and each of its starts, dumps
// its flight recorder to a folder of its own (ranks of every group are
// numbered from 0: one folder would let them overwrite each other).
TEST(ReplicaAgent, FlightDumpsGetAFolderPerGroupAndStart) {
  FakeStoreHost lighthouse;
  ReplicaAgent agent(
      {.agent = {.nproc_per_node = 4, .max_restarts = 2, .flight_dump_dir = "/tmp/fr"}, .replicas = 2},
      [](int) { return std::make_unique<FakeWorkers>(); }, [] { return std::make_unique<FakeStoreHost>(); },
      lighthouse);
  EXPECT_EQ(agent.worker_env(0, 1, 1234, 0).at("DTRAIN_FLIGHT_RECORDER_DIR"), "/tmp/fr/replica_0/attempt_0");
  EXPECT_EQ(agent.worker_env(1, 0, 1234, 2).at("DTRAIN_FLIGHT_RECORDER_DIR"), "/tmp/fr/replica_1/attempt_2");
  ReplicaAgent off(
      {.agent = {.nproc_per_node = 2}, .replicas = 2}, [](int) { return std::make_unique<FakeWorkers>(); },
      [] { return std::make_unique<FakeStoreHost>(); }, lighthouse);
  EXPECT_EQ(off.worker_env(0, 0, 1234, 0).count("DTRAIN_FLIGHT_RECORDER_DIR"), 0u);
}

// A replica group's restart that fails before its store serves leaves no
// socket open behind it.
TEST(ReplicaAgent, FailedRestartLeaksNoSocket) {
  const int before = open_fds();
  {
    FakeStoreHost lighthouse;
    int stores_made = 0;
    ReplicaAgent agent(
        {.agent = {.nproc_per_node = 2, .max_restarts = 2, .monitor_interval = std::chrono::milliseconds(1)},
         .replicas = 2},
        [](int replica) {
          auto workers = std::make_unique<FakeWorkers>();
          if (replica == 0) {
            workers->rounds = {{GroupStatus::kFailed, failed_rank(0, 1), 1}, {}};
          } else {
            workers->rounds = {{GroupStatus::kRunning, {}, 1000000}};
          }
          return workers;
        },
        [&stores_made]() -> std::unique_ptr<WorkerStoreHost> {
          if (++stores_made == 3) throw dtrain::ConfigError("no store for the restart", "test");
          return std::make_unique<FakeStoreHost>();
        },
        lighthouse);
    std::atomic<int> interrupt{0};
    EXPECT_THROW(agent.run(interrupt), dtrain::ConfigError);
    EXPECT_EQ(stores_made, 3);
  }
  EXPECT_EQ(open_fds(), before);
}

// FakeWorkers that leave what they saw in `sink` when the agent drops them
// (the agent owns its groups' WorkerGroups only while it runs).
struct SeenByGroup {
  std::vector<std::vector<WorkerLaunch>> started;
  std::vector<int> stop_signals;
};
class RecordedWorkers : public FakeWorkers {
 public:
  explicit RecordedWorkers(SeenByGroup& sink) : sink_(sink) {}
  ~RecordedWorkers() override { sink_ = {started, stop_signals}; }

 private:
  SeenByGroup& sink_;
};

// Issue 27, the chaos soak's finding (c): when the lighthouse reports every
// up-to-date replica group gone, the run restarts the whole job (every group,
// a fresh lighthouse), as for any whole-job failure: each group resumes from
// its checkpoint. It counts as a restart of every group; without one left,
// the run fails with the lighthouse's message.
TEST(ReplicaAgent, LostNewestStateRestartsEveryGroupWithAFreshLighthouse) {
  for (const int max_restarts : {1, 0}) {
    FakeStoreHost lighthouse;
    lighthouse.lost_after_checks = 3;
    std::vector<SeenByGroup> seen(2);
    ReplicaAgent agent(
        {.agent = {.nproc_per_node = 2, .max_restarts = max_restarts, .monitor_interval = std::chrono::milliseconds(1)},
         .replicas = 2},
        [&seen](int replica) {
          auto workers = std::make_unique<RecordedWorkers>(seen.at(replica));
          workers->rounds = {{GroupStatus::kRunning, {}, 1000000}, {GroupStatus::kSucceeded, {}, 2}};
          return workers;
        },
        [] { return std::make_unique<FakeStoreHost>(); }, lighthouse);
    std::atomic<int> interrupt{0};
    const AgentResult result = agent.run(interrupt);
    if (max_restarts == 1) {
      EXPECT_EQ(result.state, AgentState::kSucceeded);
      EXPECT_EQ(result.restarts, 1);
      EXPECT_EQ(lighthouse.served.size(), 2u) << "the lighthouse is served afresh";
      for (const SeenByGroup& g : seen) {
        ASSERT_EQ(g.started.size(), 2u) << "every group restarts";
        EXPECT_EQ(g.stop_signals, std::vector<int>{SIGTERM});
        EXPECT_EQ(g.started[1][0].env.at("TORCHELASTIC_RESTART_COUNT"), "1");
      }
    } else {
      EXPECT_EQ(result.state, AgentState::kFailed);
      EXPECT_NE(result.exit_code, 0);
      EXPECT_NE(result.root_cause_text.find("every up-to-date group is gone"), std::string::npos)
          << result.root_cause_text;
      EXPECT_EQ(lighthouse.served.size(), 1u);
      for (const SeenByGroup& g : seen) EXPECT_EQ(g.started.size(), 1u);
    }
  }
}

// The lighthouse failover (Note [Lighthouse failover]): with a standby,
// node 1 keeps it on the standby's port (bound only when it takes over:
// no socket yet) and every worker gets both candidates, node 0's first;
// node 0 started again while the standby serves hosts no lighthouse and
// points its workers at the standby only.
TEST(ReplicaAgent, StandbyOnNodeOneAndNodeZeroStartedAgainAfterTheFailover) {
  struct Case {
    int node;
    bool standby_serves;
  };
  for (const Case c : {Case{1, false}, Case{0, false}, Case{0, true}}) {
    FakeStoreHost lighthouse;
    std::vector<SeenByGroup> seen(4);
    std::vector<std::string> probed;
    ReplicaAgent agent(
        {.agent = {.nproc_per_node = 2, .monitor_interval = std::chrono::milliseconds(1)},
         .replicas = 4,
         .lighthouse_port = c.node == 0 ? 0 : 29777,
         .nodes = 2,
         .node_rank = c.node,
         .lighthouse_host = "node0",
         .standby_host = "node1",
         .standby_port = 29801,
         .lighthouse_serves =
             [&](const std::string& host, int port) {
               probed.push_back(host + ":" + std::to_string(port));
               return c.standby_serves;
             }},
        [&seen](int replica) {
          auto workers = std::make_unique<RecordedWorkers>(seen.at(replica));
          workers->rounds = {{}};
          return workers;
        },
        [] { return std::make_unique<FakeStoreHost>(); }, lighthouse);
    std::atomic<int> interrupt{0};
    EXPECT_EQ(agent.run(interrupt).state, AgentState::kSucceeded);
    const std::string where = seen.at(c.node * 2).started.at(0).at(0).env.at("DTRAIN_FT_LIGHTHOUSE");
    if (c.node == 1) {
      ASSERT_EQ(lighthouse.served.size(), 1u);
      EXPECT_EQ(lighthouse.served[0].port, 29801);
      EXPECT_FALSE(lighthouse.served[0].listening) << "the standby's port was bound before it took over";
      EXPECT_EQ(where, "node0:29777,node1:29801");
      EXPECT_TRUE(probed.empty());
    } else if (!c.standby_serves) {
      ASSERT_EQ(lighthouse.served.size(), 1u);
      EXPECT_EQ(where, "127.0.0.1:" + std::to_string(lighthouse.served[0].port) + ",node1:29801");
      EXPECT_EQ(probed, (std::vector<std::string>{"node1:29801"}));
    } else {
      EXPECT_TRUE(lighthouse.served.empty()) << "node 0 hosted a second lighthouse beside the standby";
      EXPECT_EQ(where, "node1:29801");
    }
  }
}

// Replica groups on several nodes (issue 27 item 3): node 1 of 2 runs groups
// 2 and 3 of 4, points its workers at node 0's lighthouse and hosts none;
// node 0 hosts it and serves it `linger` longer than its own groups ran.
TEST(ReplicaAgent, NodeRunsItsShareOfTheGroupsUnderNodeZerosLighthouse) {
  for (const int node : {0, 1}) {
    FakeStoreHost lighthouse;
    std::vector<SeenByGroup> seen(4);
    ReplicaAgent agent(
        {.agent = {.nproc_per_node = 4, .monitor_interval = std::chrono::milliseconds(1)},
         .replicas = 4,
         .lighthouse_port = node == 0 ? 0 : 29777,  // node 0 binds a free one
         .nodes = 2,
         .node_rank = node,
         .lighthouse_host = "node0",
         .linger = std::chrono::milliseconds(300)},
        [&seen](int replica) {
          auto workers = std::make_unique<RecordedWorkers>(seen.at(replica));
          workers->rounds = {{}};
          return workers;
        },
        [] { return std::make_unique<FakeStoreHost>(); }, lighthouse);
    const auto t0 = std::chrono::steady_clock::now();
    std::atomic<int> interrupt{0};
    EXPECT_EQ(agent.run(interrupt).state, AgentState::kSucceeded);
    const auto took = std::chrono::steady_clock::now() - t0;
    for (int i = 0; i < 2; ++i) {
      const int id = node * 2 + i;
      ASSERT_EQ(seen[id].started.size(), 1u) << "node " << node << " did not start group " << id;
      const auto& env = seen[id].started.at(0).at(0).env;
      EXPECT_EQ(env.at("DTRAIN_FT_REPLICA_ID"), std::to_string(node * 2 + i));
      EXPECT_EQ(env.at("DTRAIN_FT_REPLICAS"), "4");
      EXPECT_EQ(env.at("WORLD_SIZE"), "2");
      const std::string where = env.at("DTRAIN_FT_LIGHTHOUSE");
      if (node == 0) {
        EXPECT_EQ(where, "127.0.0.1:" + std::to_string(lighthouse.served.at(0).port));
      } else {
        EXPECT_EQ(where, "node0:29777");
      }
    }
    if (node == 0) {
      EXPECT_EQ(lighthouse.served.size(), 1u);
      EXPECT_GE(took, std::chrono::milliseconds(300)) << "node 0 did not linger";
    } else {
      EXPECT_TRUE(lighthouse.served.empty()) << "node 1 hosts no lighthouse";
      EXPECT_LT(took, std::chrono::milliseconds(300));
    }
  }
}
