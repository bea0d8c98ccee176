// The lighthouse failover (Note [Lighthouse failover] in
// src/ft/lighthouse_failover.cpp), with replica groups as threads over TCP
// stores: the candidates' text form, clients that move to the standby when
// the primary is lost (ids above the lost ones, a fresh group, a vote in
// flight taken as abort), a replica group started after the loss finding the
// standby, and a standby that never takes over for a primary it never saw.
#include <gtest/gtest.h>

#include <future>
#include <map>
#include <thread>

#include "dtrain/error.h"
#include "dtrain/ft/lighthouse.h"
#include "dtrain/ft/standby_lighthouse.h"
#include "ranks.h"

namespace dtrain::ft {
namespace {

using dtrain::testing::free_port;
using std::chrono::milliseconds;

LighthouseOptions failover_lighthouse(int replicas) {
  return {.min_replicas = 1,
          .startup_replicas = replicas,
          .heartbeat_timeout = milliseconds(400),
          .join_timeout = milliseconds(3000),
          .scan_interval = milliseconds(10)};
}

std::unique_ptr<LighthouseClient> failover_client(const std::vector<LighthouseAddress>& candidates, int id) {
  return std::make_unique<LighthouseClient>(candidates,
                                            LighthouseClientOptions{.replica_id = id,
                                                                    .heartbeat_interval = milliseconds(50),
                                                                    .quorum_timeout = milliseconds(15000),
                                                                    .commit_timeout = milliseconds(3000),
                                                                    .lighthouse_timeout = milliseconds(2000),
                                                                    .failover_timeout = milliseconds(15000),
                                                                    .candidate_timeout = milliseconds(300)});
}

// A primary lighthouse and a standby watching it, on loopback.
struct TwoLighthouses {
  std::unique_ptr<HostedLighthouse> primary;
  std::unique_ptr<StandbyLighthouse> standby;
  std::vector<LighthouseAddress> candidates;
};

TwoLighthouses two_lighthouses(int replicas, int standby_replicas) {
  TwoLighthouses t;
  t.primary = host_lighthouse({.port = 0, .lighthouse = failover_lighthouse(replicas)});
  const int port = free_port();
  t.candidates = {{.host = "127.0.0.1", .port = t.primary->port()}, {.host = "127.0.0.1", .port = port}};
  t.standby = std::make_unique<StandbyLighthouse>(
      StandbyLighthouseOptions{.primary = t.candidates[0],
                               .port = port,
                               .failover_timeout = milliseconds(1000),
                               .poll_interval = milliseconds(50),
                               .lighthouse = failover_lighthouse(standby_replicas)});
  return t;
}

// Each client asks at once with its step and votes `ok`; the quorums and
// decisions in client order.
std::vector<std::pair<Quorum, bool>> failover_step(const std::vector<LighthouseClient*>& clients,
                                                   const std::vector<std::int64_t>& steps) {
  std::vector<std::future<std::pair<Quorum, bool>>> out;
  for (std::size_t i = 0; i < clients.size(); ++i) {
    out.push_back(std::async(std::launch::async, [c = clients[i], s = steps[i]] {
      const Quorum q = c->quorum(s);
      return std::make_pair(q, c->agree_commit(q, true));
    }));
  }
  std::vector<std::pair<Quorum, bool>> result;
  for (auto& f : out) result.push_back(f.get());
  return result;
}

TEST(FtFailover, CandidatesAreReadInOrderAndTheSingleAddressStillWorks) {
  const auto env = [](std::map<std::string, std::string> vars) {
    return [vars](const std::string& name) -> std::optional<std::string> {
      const auto it = vars.find(name);
      if (it == vars.end()) {
        return std::nullopt;
      }
      return it->second;
    };
  };
  const auto one = lighthouse_from_env(
      env({{"DTRAIN_FT_LIGHTHOUSE", "10.0.0.1:29400"}, {"DTRAIN_FT_REPLICA_ID", "1"}, {"DTRAIN_FT_REPLICAS", "2"}}));
  EXPECT_EQ(one.candidates, (std::vector<LighthouseAddress>{{"10.0.0.1", 29400}}));
  EXPECT_EQ(one.replica_id, 1);
  const auto two = lighthouse_from_env(env({{"DTRAIN_FT_LIGHTHOUSE", "node0:29400,node1:29401"},
                                            {"DTRAIN_FT_REPLICA_ID", "0"},
                                            {"DTRAIN_FT_REPLICAS", "4"}}));
  EXPECT_EQ(two.candidates, (std::vector<LighthouseAddress>{{"node0", 29400}, {"node1", 29401}}));
  for (const char* bad : {"node0", "node0:29400,", ":1", "node0:0", "node0:29400,node1"}) {
    EXPECT_THROW(parse_lighthouse_addresses("DTRAIN_FT_LIGHTHOUSE", bad), ConfigError) << bad;
  }
}

// Node 0's loss mid-training: the clients move to the standby once it took
// over, register again, and go on from their step, with round and quorum ids
// above any the primary gave out (no pg/ or commit/ key reused); a replica
// group started afterwards finds the standby, behind, and joins.
TEST(FtFailover, ClientsMoveToTheStandbyWithIdsAboveTheLostLighthouses) {
  auto t = two_lighthouses(2, 2);
  auto a = failover_client(t.candidates, 0), b = failover_client(t.candidates, 1);
  Quorum last;
  for (std::int64_t step = 0; step < 3; ++step) {
    const auto done = failover_step({a.get(), b.get()}, {step, step});
    for (const auto& [q, commit] : done) {
      EXPECT_TRUE(commit) << q.describe();
      EXPECT_EQ(q.members.size(), 2u) << q.describe();
    }
    last = done[0].first;
  }
  EXPECT_FALSE(t.standby->serving());
  EXPECT_FALSE(lighthouse_serves(t.candidates[1], milliseconds(300))) << "the standby answered before taking over";
  EXPECT_EQ(a->connection(), 0u);

  t.primary.reset();  // node 0 lost
  const auto t0 = std::chrono::steady_clock::now();
  const auto after = failover_step({a.get(), b.get()}, {3, 3});
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(t.standby->serving());
  EXPECT_LT(took, milliseconds(10000)) << "the failover is bounded by the standby's timeout, not the clients'";
  for (const auto& [q, commit] : after) {
    EXPECT_TRUE(commit) << q.describe();
    EXPECT_EQ(q.members.size(), 2u) << q.describe();
    EXPECT_GT(q.round, last.round) << q.describe();
    EXPECT_GT(q.quorum_id, last.quorum_id) << q.describe();
    EXPECT_EQ(q.max_step(), 3) << q.describe();
  }
  EXPECT_EQ(a->connection(), 1u);
  EXPECT_EQ(b->connection(), 1u);

  auto c = failover_client(t.candidates, 2);  // started after the loss (node 0 again)
  EXPECT_EQ(c->connection(), 1u);
  // c asks first (it registers with its first request), so a and b's
  // quorum waits for it.
  auto c_quorum = std::async(std::launch::async, [&] {
    const Quorum q = c->quorum(0);
    c->agree_commit(q, true);
    return q;
  });
  std::this_thread::sleep_for(milliseconds(300));
  const auto joined = failover_step({a.get(), b.get()}, {4, 4});
  const Quorum with_c = c_quorum.get();
  ASSERT_EQ(with_c.members.size(), 3u) << with_c.describe();
  EXPECT_EQ(with_c.describe(), joined[0].first.describe());
  EXPECT_EQ(with_c.behind(), (std::vector<int>{2}));
  EXPECT_GT(with_c.quorum_id, after[0].first.quorum_id);
  t.standby->check();
}

// A vote in flight when the lighthouse is lost has no decision to read:
// each member takes it as abort (a bounded wait), and the step runs again
// at the standby.
TEST(FtFailover, AVoteInFlightWhenTheLighthouseIsLostIsAnAbort) {
  auto t = two_lighthouses(2, 2);
  auto a = failover_client(t.candidates, 0), b = failover_client(t.candidates, 1);
  const Quorum q = failover_step({a.get(), b.get()}, {0, 0})[0].first;  // step 0 committed
  Quorum q1;
  {
    std::vector<std::future<Quorum>> asks;
    for (auto* c : {a.get(), b.get()}) {
      asks.push_back(std::async(std::launch::async, [c] { return c->quorum(1); }));
    }
    q1 = asks[0].get();
    asks[1].get();
  }
  auto a_vote = std::async(std::launch::async, [&] { return a->agree_commit(q1, true); });
  std::this_thread::sleep_for(milliseconds(200));  // a waits for b's vote
  t.primary.reset();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(a_vote.get()) << "a vote without a decision committed";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(5000));
  EXPECT_FALSE(b->agree_commit(q1, true));
  const auto again = failover_step({a.get(), b.get()}, {1, 1});
  for (const auto& [quorum, commit] : again) {
    EXPECT_TRUE(commit) << quorum.describe();
    EXPECT_GT(quorum.round, q1.round) << quorum.describe();
    EXPECT_GT(quorum.quorum_id, q.quorum_id) << quorum.describe();
  }
}

// A standby that never saw the primary serve (started before node 0, or
// node 0 never came) does not serve a lighthouse of its own.
TEST(FtFailover, StandbyNeverTakesOverForAPrimaryItNeverSaw) {
  const int port = free_port();
  StandbyLighthouse standby({.primary = {.host = "127.0.0.1", .port = free_port()},
                             .port = port,
                             .failover_timeout = milliseconds(300),
                             .poll_interval = milliseconds(50),
                             .lighthouse = failover_lighthouse(1)});
  std::this_thread::sleep_for(milliseconds(1200));
  EXPECT_FALSE(standby.serving());
  EXPECT_FALSE(lighthouse_serves({.host = "127.0.0.1", .port = port}, milliseconds(300)));
  standby.check();
}

}  // namespace
}  // namespace dtrain::ft
