// Several `dtrain run` instances ("nodes") on loopback forming one group
// through the rendezvous: a 4-rank group from two nodes; a killed node shrinks
// the group and training continues; a new node grows it; none of this uses a
// restart (--max-restarts 0). Bad input: rdzv-id and --nnodes mismatches, an
// unreachable endpoint, a port held by another program, too few nodes.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <functional>
#include <regex>
#include <set>

#include "launch_helpers.h"
#include "ranks.h"
#include "test_paths.h"

using namespace dtrain::testing;

namespace {
const std::string kWorker = dtrain::testing::binary_dir() + "/tests/dtrain_elastic_worker";

// Fast failure detection for tests; the defaults suit real clusters better.
const std::string kConf = "last_call_timeout=1,heartbeat_interval=0.25,heartbeat_timeout=3";

std::vector<std::string> node_args(int port, const std::string& nnodes, const std::string& id = "elastic") {
  return {"--nnodes",       nnodes, "--nproc-per-node", "2",   "--rdzv-endpoint", "127.0.0.1:" + std::to_string(port),
          "--rdzv-id",      id,     "--rdzv-conf",      kConf, "--rdzv-timeout",  "60",
          "--max-restarts", "0",    "--stop-grace",     "2"};
}

std::vector<std::string> with_program(std::vector<std::string> args, const std::vector<std::string>& program) {
  args.insert(args.end(), program.begin(), program.end());
  return args;
}

// World sizes seen in steps.log, in order of first appearance per round.
struct Progress {
  std::vector<std::pair<int, int>> rounds;  // (round, world), in order
  int last_step = -1;
};

Progress read_progress(const fs::path& dir) {
  Progress p;
  std::istringstream in(slurp(dir / "steps.log"));
  std::string line;
  std::set<int> seen;
  const std::regex re("round (\\d+) world (\\d+) rank \\d+ step (\\d+)");
  std::smatch m;
  while (std::getline(in, line)) {
    if (!std::regex_match(line, m, re)) continue;
    const int round = std::stoi(m[1]), world = std::stoi(m[2]), step = std::stoi(m[3]);
    if (seen.insert(round).second) p.rounds.emplace_back(round, world);
    p.last_step = std::max(p.last_step, step);
  }
  return p;
}

bool has_round_with_world(const fs::path& dir, int world, int after_round = -1) {
  for (const auto& [round, w] : read_progress(dir).rounds) {
    if (w == world && round > after_round) return true;
  }
  return false;
}

int last_round(const fs::path& dir) {
  const auto p = read_progress(dir);
  return p.rounds.empty() ? -1 : p.rounds.back().first;
}

// elastic_worker's settings for this test (inherited by every launcher):
// its folder, the steps to reach, the time of one step; and the workers'
// collective timeout when `timeout_seconds` is given.
void worker_env(const Scratch& s, int steps, int step_ms, int timeout_seconds = 0) {
  ::setenv("ELASTIC_DIR", s.path().c_str(), 1);
  ::setenv("ELASTIC_STEPS", std::to_string(steps).c_str(), 1);
  ::setenv("ELASTIC_STEP_MS", std::to_string(step_ms).c_str(), 1);
  if (timeout_seconds > 0) ::setenv("DTRAIN_TIMEOUT_SECONDS", std::to_string(timeout_seconds).c_str(), 1);
}
}  // namespace

TEST(Elastic, TwoNodesFormAGroupThatShrinksAndGrowsWithoutRestarts) {
  Scratch s;
  const int port = free_port();
  worker_env(s, 160, 40, 20);
  const auto args = with_program(node_args(port, "1:2"), {kWorker});

  Launch a(args, s, "a");  // hosts the store (first to bind the endpoint's port)
  ASSERT_TRUE(wait_for([&] { return a.err().find("hosting the rendezvous store") != std::string::npos; })) << a.err();
  Launch b(args, s, "b");
  // Two nodes x two workers: one 4-rank group.
  ASSERT_TRUE(wait_for([&] { return has_round_with_world(s.path(), 4); })) << a.err() << b.err();
  const int formed = last_round(s.path());

  ::kill(b.pid(), SIGKILL);  // node b and (PDEATHSIG) its workers
  b.wait();
  ASSERT_TRUE(wait_for([&] { return has_round_with_world(s.path(), 2, formed); })) << a.err();
  const int shrunk = last_round(s.path());
  const int step_at_shrink = read_progress(s.path()).last_step;
  EXPECT_GT(step_at_shrink, 0);

  Launch c(args, s, "c");  // a new node: the group grows back to 4 ranks
  ASSERT_TRUE(wait_for([&] { return has_round_with_world(s.path(), 4, shrunk); })) << a.err() << c.err();

  EXPECT_EQ(a.wait(), 0) << a.err();
  EXPECT_EQ(c.wait(), 0) << c.err();
  const auto progress = read_progress(s.path());
  EXPECT_EQ(progress.last_step, 159);  // every step done, resumed across regroupings
  EXPECT_NE(a.err().find("membership changed: node"), std::string::npos) << a.err();
  EXPECT_NE(a.err().find("was lost"), std::string::npos) << a.err();
  EXPECT_NE(a.err().find("a new node is waiting to join"), std::string::npos) << a.err();
  EXPECT_EQ(a.err().find("restarting the workers"), std::string::npos) << a.err();
  // World sizes in order: 4, then 2, then 4 again.
  std::vector<int> worlds;
  for (const auto& [round, world] : progress.rounds) {
    if (worlds.empty() || worlds.back() != world) worlds.push_back(world);
  }
  EXPECT_EQ(worlds, (std::vector<int>{4, 2, 4})) << slurp(s.path() / "steps.log").substr(0, 2000);
}

TEST(Elastic, StaticGroupOrdersNodesByNodeRank) {
  Scratch s;
  const int port = free_port();
  const auto worker = s.script("w.sh", "echo \"rank $RANK group $GROUP_RANK world $WORLD_SIZE\"\n");
  auto args0 = node_args(port, "2");
  auto args1 = args0;
  args0.insert(args0.end(), {"--node-rank", "1", "--tee", worker});
  args1.insert(args1.end(), {"--node-rank", "0", "--tee", worker});
  Launch first(args0, s, "0");  // arrives first, but asks for node rank 1
  ASSERT_TRUE(wait_for([&] { return first.err().find("joined rendezvous round 0") != std::string::npos; }));
  Launch second(args1, s, "1");
  EXPECT_EQ(first.wait(), 0) << first.err();
  EXPECT_EQ(second.wait(), 0) << second.err();
  EXPECT_NE(first.out().find("rank 2 group 1 world 4"), std::string::npos) << first.out();
  EXPECT_NE(first.out().find("rank 3 group 1 world 4"), std::string::npos) << first.out();
  EXPECT_NE(second.out().find("rank 0 group 0 world 4"), std::string::npos) << second.out();
}

TEST(Elastic, WorkerFailureUsesARestartAndExhaustedRestartsStopEveryNode) {
  Scratch s;
  const int port = free_port();
  // Rank 3 (on the second node) fails in every round.
  const auto worker = s.script("w.sh", "if [ \"$RANK\" = 3 ]; then echo boom >&2; exit 7; fi\nsleep 30\n");
  auto args = node_args(port, "2");
  args[args.size() - 3] = "1";  // --max-restarts 1
  args.push_back(worker);
  Launch a(args, s, "a");
  ASSERT_TRUE(wait_for([&] { return a.err().find("hosting the rendezvous store") != std::string::npos; }));
  Launch b(args, s, "b");
  EXPECT_EQ(a.wait(), 7) << a.err();
  EXPECT_EQ(b.wait(), 7) << b.err();
  EXPECT_NE(b.err().find("restarting the workers (restart 1 of 1)"), std::string::npos) << b.err();
  for (const auto* l : {&a, &b}) {
    EXPECT_NE(l->err().find("root cause: rank 3 (local rank 1) exited with code 7"), std::string::npos) << l->err();
  }
}

TEST(Elastic, BadInputFailsClearly) {
  Scratch s;
  const auto ok = s.script("ok.sh", "sleep 1\n");
  {
    // A node of another run is refused; so is another --nnodes.
    const int port = free_port();
    auto host_args = node_args(port, "2", "job-a");
    host_args[host_args.size() - 5] = "4";  // --rdzv-timeout 4: it then times out waiting for its peer
    host_args.push_back(ok);
    Launch host(host_args, s, "host");
    ASSERT_TRUE(wait_for([&] { return host.err().find("joined rendezvous round 0") != std::string::npos; }));
    Launch other(with_program(node_args(port, "2", "job-b"), {ok}), s, "other");
    EXPECT_EQ(other.wait(), 2);
    EXPECT_NE(other.err().find("belongs to run 'job-a', but this node has --rdzv-id 'job-b'; refusing to join"),
              std::string::npos)
        << other.err();
    Launch sizes(with_program(node_args(port, "1:3", "job-a"), {ok}), s, "sizes");
    EXPECT_EQ(sizes.wait(), 2);
    EXPECT_NE(sizes.err().find("was started with --nnodes 2:2, but this node has --nnodes 1:3"), std::string::npos)
        << sizes.err();
    // Too few nodes: the host gives up after --rdzv-timeout.
    EXPECT_EQ(host.wait(), 2);
    EXPECT_NE(host.err().find("round 0 has 1 of at least 2 nodes within"), std::string::npos) << host.err();
  }
  {
    // Nothing routes to TEST-NET-1: the connection times out with a message.
    Launch l({"--nnodes", "2", "--rdzv-endpoint", "192.0.2.1:29400", "--rdzv-timeout", "1", ok}, s, "unreachable");
    EXPECT_EQ(l.wait(std::chrono::seconds(30)), 2);
    EXPECT_NE(l.err().find("could not reach the rendezvous store at 192.0.2.1:29400"), std::string::npos) << l.err();
  }
  {
    // The endpoint's port is held by a program that is not a store.
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(::listen(fd, 8), 0);
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    const std::string endpoint = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
    Launch l({"--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-timeout", "1", ok}, s, "busy");
    EXPECT_EQ(l.wait(std::chrono::seconds(30)), 2);
    EXPECT_NE(l.err().find("the rendezvous endpoint " + endpoint + " accepted a connection but did not answer"),
              std::string::npos)
        << l.err();
    ::close(fd);
  }
  {
    Launch l({"--nnodes", "2", ok}, s, "noendpoint");
    EXPECT_EQ(l.wait(), 2);
    EXPECT_NE(l.err().find("--nnodes 2 needs a rendezvous endpoint"), std::string::npos) << l.err();
  }
}

namespace {
// n network namespaces on one bridge (in the root namespace): namespace i
// has dteth0 at 10.77.0.<i+1>/24, so nodes are "machines" with real, distinct
// addresses that reach each other only over the bridge. Needs root and
// iproute2; usable() is false where namespaces cannot be made.
class NamespaceLan {
 public:
  explicit NamespaceLan(int n) {
    const std::string id = std::to_string(::getpid() % 100000);
    bridge_ = "dtbr" + id;
    ok_ = sh("ip link add " + bridge_ + " type bridge") && sh("ip link set " + bridge_ + " up");
    for (int i = 0; ok_ && i < n; ++i) {
      const std::string ns = "dtrain_" + std::to_string(i) + "_" + id;
      const std::string inside = "dtv" + std::to_string(i) + "i" + id, outside = "dtv" + std::to_string(i) + "o" + id;
      names_.push_back(ns);
      ok_ = sh("ip netns add " + ns) && sh("ip link add " + inside + " type veth peer name " + outside) &&
            sh("ip link set " + inside + " netns " + ns) && sh("ip link set " + outside + " master " + bridge_) &&
            sh("ip link set " + outside + " up") && sh("ip -n " + ns + " link set " + inside + " name dteth0") &&
            sh("ip -n " + ns + " addr add " + address(i) + "/24 dev dteth0") &&
            sh("ip -n " + ns + " link set dteth0 up") && sh("ip -n " + ns + " link set lo up");
    }
  }
  ~NamespaceLan() {
    for (const auto& ns : names_) sh("ip netns del " + ns);
    sh("ip link del " + bridge_);
  }
  bool usable() const { return ok_; }
  static std::string address(int i) { return "10.77.0." + std::to_string(i + 1); }
  std::vector<std::string> in(int i) const { return {"ip", "netns", "exec", names_[static_cast<std::size_t>(i)]}; }

 private:
  static bool sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }
  std::string bridge_;
  std::vector<std::string> names_;
  bool ok_ = false;
};

constexpr int kFailoverSteps = 150;

// Issue 30: once a node moved to a failover store, its log names that
// store's real address, never the endpoint's: every round it joins after the
// move is "at" the address the move named.
void expect_rounds_named_at_the_failover_store(const std::string& log) {
  static const std::regex moved(R"(the rendezvous store of generation \d+ at (\S+))");
  static const std::regex joined(R"(joined rendezvous round \d+ at (\S+))");
  std::smatch m;
  const auto at = std::regex_search(log, m, moved) ? m.position(0) : std::string::npos;
  ASSERT_NE(at, std::string::npos) << log;
  const std::string store = m[1];
  const std::string after = log.substr(at);
  int rounds = 0;
  for (auto it = std::sregex_iterator(after.begin(), after.end(), joined); it != std::sregex_iterator(); ++it) {
    EXPECT_EQ((*it)[1].str(), store) << after;
    ++rounds;
  }
  EXPECT_GT(rounds, 0) << after;
}

// Note [Store-host failover]: three nodes (one worker each) run `args`, each
// launcher through `wrap(i)` (e.g. into its network namespace); once the
// 3-node group trains, the first node (hosting the store) is SIGKILLed. The
// two survivors must form a 2-node round on a generation-1 store and finish
// every step. Returns the survivors' logs, joined (and one by one in
// `survivor_logs`), for further checks.
std::string expect_store_host_loss_survived(const std::vector<std::string>& args, const Scratch& s,
                                            const std::function<std::vector<std::string>(int)>& wrap,
                                            std::vector<std::string>* survivor_logs = nullptr) {
  Launch a(args, s, "a", wrap(0));  // hosts the store of generation 0
  EXPECT_TRUE(wait_for([&] { return a.err().find("hosting the rendezvous store") != std::string::npos; })) << a.err();
  Launch b(args, s, "b", wrap(1));
  Launch c(args, s, "c", wrap(2));
  EXPECT_TRUE(wait_for([&] { return has_round_with_world(s.path(), 3); })) << a.err() << b.err() << c.err();
  const int formed = last_round(s.path());
  ::kill(a.pid(), SIGKILL);
  a.wait();
  EXPECT_TRUE(wait_for([&] { return has_round_with_world(s.path(), 2, formed); })) << b.err() << c.err();
  EXPECT_EQ(b.wait(), 0) << b.err();
  EXPECT_EQ(c.wait(), 0) << c.err();
  EXPECT_EQ(read_progress(s.path()).last_step, kFailoverSteps - 1);
  const std::string both = b.err() + c.err();
  EXPECT_NE(both.find("hosting the rendezvous store of generation 1"), std::string::npos) << both;
  EXPECT_NE(both.find("joined the rendezvous store of generation 1"), std::string::npos) << both;
  EXPECT_EQ(both.find("restarting the workers"), std::string::npos) << both;
  if (survivor_logs != nullptr) *survivor_logs = {b.err(), c.err()};
  return both;
}
}  // namespace

TEST(Elastic, NodesOnTwoNetworkNamespacesTrainTogether) {
  NamespaceLan net(2);
  if (!net.usable()) GTEST_SKIP() << "cannot create network namespaces here (needs root and iproute2)";
  Scratch s;
  worker_env(s, 20, 10);
  ::setenv("GLOO_SOCKET_IFNAME", "dteth0", 1);  // the workers' Gloo transport
  const std::vector<std::string> args = {
      "--nnodes",  "2",     "--nproc-per-node", "1",  "--rdzv-endpoint", "10.77.0.1:29400",
      "--rdzv-id", "netns", "--rdzv-timeout",   "30", "--tee",           kWorker};
  Launch a(args, s, "a", net.in(0));
  ASSERT_TRUE(wait_for([&] { return a.err().find("hosting the rendezvous store") != std::string::npos; })) << a.err();
  Launch b(args, s, "b", net.in(1));
  EXPECT_EQ(a.wait(), 0) << a.err();
  EXPECT_EQ(b.wait(), 0) << b.err();
  ::unsetenv("GLOO_SOCKET_IFNAME");
  const auto progress = read_progress(s.path());
  EXPECT_EQ(progress.last_step, 19);
  ASSERT_FALSE(progress.rounds.empty());
  EXPECT_EQ(progress.rounds.front().second, 2);
  // b reached a's store over the veth link, not loopback.
  EXPECT_NE(b.err().find("joined rendezvous round 0 at 10.77.0.1:29400"), std::string::npos) << b.err();
}

// Note [Store-host failover]: three nodes (one worker each), and the node
// hosting the rendezvous store is SIGKILLed mid-training. The two survivors
// move to a store hosted by the one with the lower node rank, form a 2-node
// round as a membership change (--max-restarts 0), and finish every step.
// Joins are authenticated (a shared secret) in both generations.
TEST(Elastic, LosingTheStoreHostIsSurvivedByTheOthers) {
  Scratch s;
  const int port = free_port();
  worker_env(s, kFailoverSteps, 40, 20);
  auto args = node_args(port, "2:3");
  args[3] = "1";  // --nproc-per-node 1
  {               // with a shared secret: the successor gates its store with it too
    std::ofstream(s.path() / "secret") << "failover-secret-0123456789";
  }
  args.insert(args.end(), {"--rdzv-secret-file", (s.path() / "secret").string()});
  expect_store_host_loss_survived(with_program(args, {kWorker}), s, [](int) { return std::vector<std::string>{}; });
}

// With two nodes the survivor of a store-host loss is no majority of the last
// round: it stops with an error that says why (a partition must not leave two
// halves training) -- unless --rdzv-conf failover_quorum=min, when it trains on.
TEST(Elastic, AStoreHostLossWithoutMajorityStopsUnlessQuorumIsMin) {
  for (const bool min_quorum : {false, true}) {
    SCOPED_TRACE(min_quorum ? "failover_quorum=min" : "majority");
    Scratch s;
    const int port = free_port();
    worker_env(s, 100, 40, 20);
    auto args = node_args(port, "1:2");
    args[3] = "1";
    args[9] = kConf + (min_quorum ? ",failover_quorum=min" : "");  // --rdzv-conf
    args[11] = "10";                                               // --rdzv-timeout
    args = with_program(args, {kWorker});
    Launch a(args, s, "a");
    ASSERT_TRUE(wait_for([&] { return a.err().find("hosting the rendezvous store") != std::string::npos; }));
    Launch b(args, s, "b");
    ASSERT_TRUE(wait_for([&] { return has_round_with_world(s.path(), 2); })) << a.err() << b.err();
    ::kill(a.pid(), SIGKILL);
    a.wait();
    if (min_quorum) {
      EXPECT_EQ(b.wait(std::chrono::seconds(90)), 0) << b.err();
      EXPECT_EQ(read_progress(s.path()).last_step, 99);
      EXPECT_NE(b.err().find("hosting the rendezvous store of generation 1"), std::string::npos) << b.err();
    } else {
      EXPECT_NE(b.wait(std::chrono::seconds(90)), 0) << b.err();
      EXPECT_NE(b.err().find("fewer than a majority (2)"), std::string::npos) << b.err();
      EXPECT_NE(b.err().find("failover_quorum=min"), std::string::npos) << b.err();
    }
  }
}

// The same failover with real addresses: the successor hosts generation 1 at
// its own address (10.77.0.2 or .3), the other survivor finds it there, and
// both logs name that address for every round after the move.
TEST(Elastic, StoreHostLossIsSurvivedAcrossNetworkNamespaces) {
  NamespaceLan net(3);
  if (!net.usable()) GTEST_SKIP() << "cannot create network namespaces here (needs root and iproute2)";
  Scratch s;
  worker_env(s, kFailoverSteps, 40, 20);
  ::setenv("GLOO_SOCKET_IFNAME", "dteth0", 1);
  const std::vector<std::string> args = {"--nnodes",
                                         "2:3",
                                         "--nproc-per-node",
                                         "1",
                                         "--rdzv-endpoint",
                                         NamespaceLan::address(0) + ":29400",
                                         "--rdzv-id",
                                         "netns-failover",
                                         "--rdzv-conf",
                                         kConf,
                                         "--rdzv-timeout",
                                         "60",
                                         "--max-restarts",
                                         "0",
                                         "--stop-grace",
                                         "2",
                                         kWorker};
  std::vector<std::string> logs;
  const std::string both = expect_store_host_loss_survived(
      args, s, [&](int i) { return net.in(i); }, &logs);
  ::unsetenv("GLOO_SOCKET_IFNAME");
  EXPECT_TRUE(both.find("hosting the rendezvous store of generation 1 at 10.77.0.2:29400") != std::string::npos ||
              both.find("hosting the rendezvous store of generation 1 at 10.77.0.3:29400") != std::string::npos)
      << both;
  EXPECT_NE(both.find("joined the rendezvous store of generation 1 at 10.77.0."), std::string::npos) << both;
  for (const std::string& log : logs) expect_rounds_named_at_the_failover_store(log);
}
