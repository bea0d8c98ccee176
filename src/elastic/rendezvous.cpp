// Rendezvous: standalone (one node) and over a shared store (several nodes).
//
// Note [Rendezvous protocol]
// Keys live under dtrain/rdzv/. Round r has:
//   r<r>/joined        arrival counter: a node's arrival index is add(joined, 1) - 1
//   r<r>/node<i>       arrival i's record: node id, address, workers, --node-rank
//   r<r>/restarts      the round's restart count, written by whoever closes it
//   r<r>/closed        N: the first N arrivals are the round's members
//   r<r>/master        MASTER_ADDR:MASTER_PORT, published by node rank 0
//   r<r>/end           why the round ended (first writer wins): membership change or failure
//   r<r>/left<i>       arrival i is finished with the job (succeeded, or gave up);
//                      the store's host and node rank 0 (the workers' store) wait for these
// and hb/<node id> is each node's heartbeat counter.
// - Joining: a new node joins the newest round, or the one after it if the
//   newest is closed (then it waits there, and its arrival tells the running
//   members that a node wants in).
// - Closing: any member closes round r (create-if-absent, so one value wins)
//   once round r-1 has ended, and either MAX nodes joined or at least MIN did
//   and no new one arrived for the last-call period. Arrivals past N wait for
//   round r+1.
// - Node ranks follow --node-rank where given, then arrival order. Ranks are
//   contiguous per node.
// - Ending: a member ends the round when one of its workers fails (a failure:
//   the next round's restart count is one higher, and with none left every
//   node gives up), when a member's heartbeat stops for the heartbeat timeout
//   (a lost node), or when a node is waiting and the round has fewer than MAX
//   nodes (growth). The last two are membership changes and use no restart.
//   A worker failure is first checked against lost peers for up to a
//   heartbeat timeout: when a node dies, the others' workers fail in their
//   collectives at once, and that must not be counted as a restart.
// - Heartbeats are counters, not timestamps, so clocks need not agree.
//
// Note [Store-host failover]
// The store lives in the agent of the node the endpoint names. When that node
// is lost, the others go on with a store of the next generation:
// - What every node knows. Each member caches the last round it joined: its
//   number, restart count and the members' records (id, address, node rank,
//   and whether the node hosted the store), read when the round closed.
// - Detection. A store operation of the rendezvous (heartbeat, poll, a
//   failure report, joining) fails with CommunicationError: the host's
//   process is gone (connection reset). The entry point then fails over
//   (State::failover) instead of ending the job.
// - Successor. Every survivor walks the cached members in node-rank order,
//   skipping the old host. When the candidate is itself, it hosts generation
//   G+1 at its own address and the endpoint's port, seeds it (run id,
//   --nnodes, the cached round as closed and ended by a membership change
//   with its restart count, the first round of G+1, the quorum) and writes
//   `generation` last. Otherwise it connects to the candidate's address for
//   up to 2 heartbeat timeouts + last call and accepts the store only if it
//   says generation G+1 (a stale store or a half-seeded one is never joined);
//   failing that it moves to the next candidate. All survivors compute the
//   same order, so they meet at the same node.
// - Quorum (no split brain). The first round of G+1 closes only with at least
//   MIN nodes and a strict majority of the cached round's members. Under a
//   partition at most one side holds a majority, so at most one side goes
//   on; a side without one stops after --rdzv-timeout with a RendezvousError
//   saying why. A 2-node job whose store host dies therefore stops (1 of 2 is
//   no majority) unless --rdzv-conf failover_quorum=min trades that guarantee
//   for availability (safe whenever MIN > N/2, where the two coincide).
// - The round after a failover is a membership change: it uses no restart,
//   and training resumes from the last checkpoint as after any lost node.
//   The workers' store needs nothing new: node rank 0 of each round hosts it.
// - Authentication carries over: the successor gates its store with the same
//   secret (Note [Rendezvous authentication]); clients tunnel as before.
// Limits: detection relies on the connection failing. A host cut off by a
// partition (no reset) is noticed only when the store client's timeout
// (--rdzv-timeout) expires. Survivors must have been members of the same
// last round (true unless the host dies while a round is closing). New nodes
// know only --rdzv-endpoint: after a failover they can join only if the
// endpoint is a name that follows the host (a Kubernetes Service, DNS).
// Tests: Elastic.LosingTheStoreHostIsSurvivedByTheOthers (loopback, with a
// secret), Elastic.StoreHostLossIsSurvivedAcrossNetworkNamespaces,
// Elastic.AStoreHostLossWithoutMajorityStopsUnlessQuorumIsMin.
#include "dtrain/elastic/rendezvous.h"

#include "../core/net.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "dtrain/elastic/agent.h"
#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain::elastic {

StandaloneRendezvous::StandaloneRendezvous(int nproc, int max_restarts, std::string master_addr, int master_port)
    : nproc_(nproc), max_restarts_(max_restarts), master_addr_(std::move(master_addr)), master_port_(master_port) {}

RoundPlan StandaloneRendezvous::next_round() {
  RoundPlan plan;
  plan.round = ++round_;
  plan.restart_count = restart_count_;
  plan.world_size = nproc_;
  plan.master_addr = master_addr_;
  plan.master_port = master_port_;
  plan.master_listen_fd = net::listen_tcp(plan.master_port);
  return plan;
}

RoundEnding StandaloneRendezvous::report_failure(const WorkerExit& failure) {
  RoundEnding e{.kind = RoundEnding::Kind::kFailure,
                .reason = failure.describe(),
                .give_up = restart_count_ >= max_restarts_,
                .exit_code = failure.launcher_exit_code()};
  if (!e.give_up) ++restart_count_;
  return e;
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollSleep = std::chrono::milliseconds(20);

std::string key(const std::string& k) {
  return "dtrain/rdzv/" + k;
}
std::string round_key(int r, const std::string& k) {
  return key("r" + std::to_string(r) + "/" + k);
}

std::string encode(const RoundEnding& e) {
  return nlohmann::json{{"kind", e.kind == RoundEnding::Kind::kFailure ? "failure" : "membership"},
                        {"reason", e.reason},
                        {"give_up", e.give_up},
                        {"exit_code", e.exit_code}}
      .dump();
}

RoundEnding decode(const std::string& text) {
  const auto j = nlohmann::json::parse(text);
  return {.kind = j.at("kind") == "failure" ? RoundEnding::Kind::kFailure : RoundEnding::Kind::kMembershipChange,
          .reason = j.at("reason"),
          .give_up = j.at("give_up"),
          .exit_code = j.at("exit_code")};
}

std::string make_node_id() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::random_device rd;
  char suffix[16];
  std::snprintf(suffix, sizeof suffix, "%04x", static_cast<unsigned>(rd() & 0xffff));
  return std::string(host) + ":" + std::to_string(::getpid()) + ":" + suffix;
}

struct NodeRecord {
  int index = 0;  // arrival index
  std::string id;
  std::string addr;
  int nproc = 1;
  int node_rank = -1;
  bool hosts = false;  // hosted the store when it joined
};

}  // namespace

struct StoreRendezvous::State {
  std::shared_ptr<RendezvousStore> store;
  StoreRendezvousOptions opt;
  std::string node_id;
  int next_round = -1;  // -1: never joined
  // The current round.
  int round = -1;
  int restart_count = 0;
  int my_index = -1;
  std::vector<NodeRecord> members;  // in node-rank order
  std::vector<std::int64_t> peer_beat;
  std::vector<Clock::time_point> peer_seen;
  Clock::time_point last_heartbeat{};
  Clock::time_point last_peer_check{};
  int generation = 0;  // stores hosted so far after the first (Note [Store-host failover])
  // The last closed round this node knows (as a member, or the one before the
  // round it waits in): who would host the next generation.
  int known_round = -1;
  int known_restarts = 0;
  std::vector<NodeRecord> known_members;  // in node-rank order

  // Round r's `closed` members from their records, in node-rank order.
  std::vector<NodeRecord> read_members(int r, int closed, Clock::time_point deadline);

  // The first round of this store's generation (0 for the first store).
  int first_round() {
    const auto v = store->try_get(key("first_round"));
    return v ? std::stoi(*v) : 0;
  }

  // Nodes the first round of a generation needs besides MIN (0: none).
  int quorum_for(int r) {
    if (r != first_round()) return 0;
    const auto v = store->try_get(key("quorum"));
    return v ? std::stoi(*v) : 0;
  }

  // Note [Store-host failover]: after the store's host was lost, moves to the
  // next generation's store, hosted by the surviving member of the last round
  // with the lowest node rank; false when this node never was a member (it
  // knows no one) or no candidate could host or be reached.
  bool failover(const std::string& why);

  void heartbeat(bool force = false) {
    const auto now = Clock::now();
    if (!force && now - last_heartbeat < opt.heartbeat_interval) return;
    store->add(key("hb/" + node_id), 1);
    last_heartbeat = now;
  }

  bool exists(const std::string& k) { return store->try_get(k).has_value(); }

  std::optional<RoundEnding> ended() {
    if (auto v = store->try_get(round_key(round, "end"))) return decode(*v);
    return std::nullopt;
  }

  RoundEnding end_round(const RoundEnding& mine) {
    return decode(store->create_if_absent(round_key(round, "end"), encode(mine)));
  }

  enum class Peer { kAlive, kDone, kLost };
  Peer peer_status(std::size_t j) {
    if (members[j].id == node_id) return Peer::kAlive;
    if (exists(round_key(round, "left" + std::to_string(members[j].index)))) return Peer::kDone;
    const auto v = store->try_get(key("hb/" + members[j].id));
    const std::int64_t beat = v ? std::stoll(*v) : 0;
    const auto now = Clock::now();
    if (beat != peer_beat[j]) {
      peer_beat[j] = beat;
      peer_seen[j] = now;
    }
    return now - peer_seen[j] > opt.heartbeat_timeout ? Peer::kLost : Peer::kAlive;
  }

  std::optional<std::string> lost_peer() {
    for (std::size_t j = 0; j < members.size(); ++j) {
      if (peer_status(j) == Peer::kLost) return members[j].id;
    }
    return std::nullopt;
  }

  void track_peers() {
    peer_beat.assign(members.size(), -1);
    peer_seen.assign(members.size(), Clock::now());
  }

  // The newest round that has arrivals.
  int newest_round() {
    int r = first_round();
    while (exists(round_key(r + 1, "joined"))) ++r;
    return r;
  }

  // Restart count of round r: that of the newest closed round before it,
  // plus one if that round ended in a failure.
  int restarts_for(int r) {
    for (int q = r - 1; q >= 0; --q) {
      if (!exists(round_key(q, "closed"))) continue;
      const auto rc = store->try_get(round_key(q, "restarts"));
      const auto end = store->try_get(round_key(q, "end"));
      const int base = rc ? std::stoi(*rc) : 0;
      return base + (end && decode(*end).kind == RoundEnding::Kind::kFailure ? 1 : 0);
    }
    return 0;
  }

  [[noreturn]] void timed_out(const std::string& what) {
    throw TimeoutError("rendezvous at " + opt.endpoint + " (run '" + opt.run_id + "'): " + what + " within " +
                           log::format_seconds(opt.timeout) + ".",
                       "start the other nodes with the same --rdzv-endpoint and --rdzv-id, or raise --rdzv-timeout");
  }
};

std::vector<NodeRecord> StoreRendezvous::State::read_members(int r, int closed, Clock::time_point deadline) {
  std::vector<NodeRecord> out;
  for (int i = 0; i < closed; ++i) {
    std::optional<std::string> rec;
    while (!(rec = store->try_get(round_key(r, "node" + std::to_string(i))))) {
      if (Clock::now() > deadline)
        timed_out("arrival " + std::to_string(i) + " of round " + std::to_string(r) + " never registered");
      std::this_thread::sleep_for(kPollSleep);
    }
    const auto j = nlohmann::json::parse(*rec);
    out.push_back({.index = i,
                   .id = j.at("id"),
                   .addr = j.at("addr"),
                   .nproc = j.at("nproc"),
                   .node_rank = j.at("node_rank"),
                   .hosts = j.value("hosts", false)});
  }
  std::stable_sort(out.begin(), out.end(), [](const NodeRecord& a, const NodeRecord& b) {
    return (a.node_rank < 0 ? INT_MAX : a.node_rank) < (b.node_rank < 0 ? INT_MAX : b.node_rank);
  });
  return out;
}

namespace {

// Calls `attempt` until it returns a store, then every `pause` until `until`
// has passed (at least once); an exception counts as "not yet", and the last
// one's message is left in `problem`. nullptr when time ran out.
std::shared_ptr<RendezvousStore> retry_until(Clock::time_point until, std::chrono::milliseconds pause,
                                             const std::function<std::shared_ptr<RendezvousStore>()>& attempt,
                                             std::string& problem) {
  for (;;) {
    try {
      if (auto store = attempt()) return store;
    } catch (const std::exception& e) {
      problem = e.what();
    }
    if (Clock::now() >= until) return nullptr;
    std::this_thread::sleep_for(pause);
  }
}

}  // namespace

bool StoreRendezvous::State::failover(const std::string& why) {
  if (!opt.reconnect || known_round < 0 || known_members.empty()) return false;
  const int next_generation = generation + 1;
  const std::string gen = std::to_string(next_generation);
  DTRAIN_LOG(kWarning) << "lost the rendezvous store (" << why.substr(0, why.find('\n')) << "); moving to generation "
                       << gen << ", hosted by the surviving node of round " << known_round
                       << " with the lowest node rank";
  for (const NodeRecord& c : known_members) {  // node-rank order
    if (c.hosts) continue;                     // the lost host
    if (c.id == node_id) {
      // The port may stay bound for a moment after its holder died (its
      // processes are still being torn down): retry within the others' wait.
      std::string problem;
      std::shared_ptr<RendezvousStore> next = retry_until(
          Clock::now() + 2 * opt.heartbeat_timeout, std::chrono::milliseconds(100),
          [&] { return opt.reconnect(opt.local_addr, opt.port, /*host_it=*/true, opt.heartbeat_timeout); }, problem);
      if (!next) {
        DTRAIN_LOG(kWarning) << "cannot host generation " << gen << " at " << opt.local_addr << ":" << opt.port << ": "
                             << problem << "; trying the next candidate";
        continue;
      }
      const std::string nodes = std::to_string(opt.min_nodes) + ":" + std::to_string(opt.max_nodes);
      next->set(key("run_id"), opt.run_id);
      next->set(key("nnodes"), nodes);
      next->set(key("first_round"), std::to_string(known_round + 1));
      // The last round, as ended by the loss: the next one counts restarts from it and uses none.
      next->set(round_key(known_round, "closed"), std::to_string(known_members.size()));
      next->set(round_key(known_round, "restarts"), std::to_string(known_restarts));
      next->set(round_key(known_round, "end"), encode({.kind = RoundEnding::Kind::kMembershipChange,
                                                       .reason = "the node hosting the rendezvous store was lost"}));
      next->set(key("quorum"),
                std::to_string(opt.failover_quorum_min ? 0 : static_cast<int>(known_members.size()) / 2 + 1));
      next->set(key("generation"), gen);  // last: clients take the store once it is seeded
      store = std::move(next);
      generation = next_generation;
      next_round = known_round + 1;
      DTRAIN_LOG(kInfo) << "hosting the rendezvous store of generation " << gen << " at " << opt.local_addr << ":"
                        << opt.port << " (failover)";
      return true;
    }
    // A candidate gets a heartbeat timeout to notice the loss, and then some,
    // to host; until then its store is not up (or not seeded) yet.
    std::string problem;
    int first_round = 0;
    std::shared_ptr<RendezvousStore> next = retry_until(
        Clock::now() + 2 * opt.heartbeat_timeout + opt.last_call, std::chrono::milliseconds(200),
        [&]() -> std::shared_ptr<RendezvousStore> {
          auto candidate = opt.reconnect(c.addr, opt.port, /*host_it=*/false, opt.heartbeat_timeout);
          const auto g = candidate->try_get(key("generation"));
          const auto first = candidate->try_get(key("first_round"));
          if (!g || !first || std::stoi(*g) != next_generation) return nullptr;
          first_round = std::stoi(*first);
          return candidate;
        },
        problem);
    if (next) {
      store = std::move(next);
      generation = next_generation;
      next_round = first_round;
      DTRAIN_LOG(kInfo) << "joined the rendezvous store of generation " << gen << " at " << c.addr << ":" << opt.port
                        << " (failover)";
      return true;
    }
    DTRAIN_LOG(kWarning) << "node " << c.id << " did not host generation " << gen << "; trying the next candidate";
  }
  return false;
}

StoreRendezvous::StoreRendezvous(std::shared_ptr<RendezvousStore> store, StoreRendezvousOptions options)
    : state_(std::make_unique<State>()) {
  auto& s = *state_;
  s.store = std::move(store);
  s.opt = std::move(options);
  s.node_id = make_node_id();
  DTRAIN_CHECK(s.opt.min_nodes >= 1 && s.opt.min_nodes <= s.opt.max_nodes, ConfigError,
               "--nnodes " << s.opt.min_nodes << ":" << s.opt.max_nodes << " is not a valid range.",
               "write MIN:MAX with 1 <= MIN <= MAX");
  const std::string id = s.store->create_if_absent(key("run_id"), s.opt.run_id);
  DTRAIN_CHECK(id == s.opt.run_id, ConfigError,
               "the rendezvous at " << s.opt.endpoint << " belongs to run '" << id << "', but this node has --rdzv-id '"
                                    << s.opt.run_id << "'; refusing to join.",
               "give every node of a job the same --rdzv-id, and each job its own --rdzv-endpoint");
  const std::string nodes = std::to_string(s.opt.min_nodes) + ":" + std::to_string(s.opt.max_nodes);
  const std::string config = s.store->create_if_absent(key("nnodes"), nodes);
  s.generation = std::stoi(s.store->try_get(key("generation")).value_or("0"));
  DTRAIN_CHECK(config == nodes, ConfigError,
               "run '" << s.opt.run_id << "' was started with --nnodes " << config << ", but this node has --nnodes "
                       << nodes << ".",
               "give every node the same --nnodes");
}

StoreRendezvous::~StoreRendezvous() = default;

const std::string& StoreRendezvous::node_id() const {
  return state_->node_id;
}

RoundPlan StoreRendezvous::next_round() {
  auto& s = *state_;
  for (;;) {
    try {
      return join_round();
    } catch (const CommunicationError& e) {
      if (!s.failover(e.what())) throw;
    }
  }
}

RoundPlan StoreRendezvous::join_round() {
  auto& s = *state_;
  s.heartbeat(/*force=*/true);
  int r = s.next_round;
  if (r < 0) {
    r = s.newest_round();
    if (s.exists(round_key(r, "closed"))) ++r;
  }
  for (;;) {
    auto deadline = Clock::now() + s.opt.timeout;
    const int index = static_cast<int>(s.store->add(round_key(r, "joined"), 1)) - 1;
    s.store->set(round_key(r, "node" + std::to_string(index)), nlohmann::json{{"id", s.node_id},
                                                                              {"addr", s.opt.local_addr},
                                                                              {"nproc", s.opt.nproc},
                                                                              {"node_rank", s.opt.node_rank},
                                                                              {"hosts", s.store->hosts_store()}}
                                                                   .dump());
    DTRAIN_LOG(kInfo) << "node " << s.node_id << " joined rendezvous round " << r << " at " << s.opt.endpoint
                      << " (arrival " << index << ")";
    // A node that was never a member learns who would host after a failover
    // from the round before this one (its members computed the same list).
    if (s.known_round < r - 1 && r > 0) {
      if (const auto c = s.store->try_get(round_key(r - 1, "closed"))) {
        s.known_members = s.read_members(r - 1, std::stoi(*c), deadline);
        s.known_round = r - 1;
        s.known_restarts = std::stoi(s.store->try_get(round_key(r - 1, "restarts")).value_or("0"));
      }
    }
    std::int64_t last_count = -1;
    auto last_change = Clock::now();
    int closed = -1;
    while (closed < 0) {
      s.heartbeat();
      if (auto c = s.store->try_get(round_key(r, "closed"))) {
        closed = std::stoi(*c);
        break;
      }
      const auto count = std::stoll(s.store->try_get(round_key(r, "joined")).value_or("0"));
      if (count != last_count) {
        last_count = count;
        last_change = Clock::now();
      }
      const bool previous_over = r == 0 || s.exists(round_key(r - 1, "end")) || !s.exists(round_key(r - 1, "closed"));
      const int quorum = s.quorum_for(r);
      const bool enough =
          count >= quorum &&
          (count >= s.opt.max_nodes || (count >= s.opt.min_nodes && Clock::now() - last_change >= s.opt.last_call));
      if (previous_over && enough) {
        s.store->set(round_key(r, "restarts"), std::to_string(s.restarts_for(r)));
        s.store->create_if_absent(round_key(r, "closed"),
                                  std::to_string(std::min<std::int64_t>(count, s.opt.max_nodes)));
        continue;
      }
      if (Clock::now() > deadline && previous_over && count < quorum && count >= s.opt.min_nodes) {
        throw RendezvousError(
            "rendezvous after losing the store's host: round " + std::to_string(r) + " has " + std::to_string(count) +
                " nodes, fewer than a majority (" + std::to_string(quorum) +
                ") of the last round's, so this side stops rather than train apart from the others (no split brain).",
            "the other nodes may be alive beyond a partition; restart the job, or pass --rdzv-conf "
            "failover_quorum=min to go on with --nnodes MIN nodes");
      }
      if (Clock::now() > deadline && previous_over) {
        s.timed_out("round " + std::to_string(r) + " has " + std::to_string(count) + " of at least " +
                    std::to_string(s.opt.min_nodes) + " nodes");
      }
      std::this_thread::sleep_for(kPollSleep);
    }
    if (index >= closed) {
      DTRAIN_LOG(kInfo) << "round " << r << " is full (" << closed << " nodes); waiting for the next";
      ++r;
      continue;
    }

    const std::vector<NodeRecord> members = s.read_members(r, closed, deadline);
    s.round = r;
    s.next_round = r + 1;
    s.members = members;
    s.my_index = index;
    s.track_peers();
    s.restart_count = std::stoi(s.store->try_get(round_key(r, "restarts")).value_or("0"));
    s.known_round = r;
    s.known_members = members;
    s.known_restarts = s.restart_count;

    RoundPlan plan;
    plan.round = r;
    plan.restart_count = s.restart_count;
    plan.nnodes = closed;
    plan.world_size = 0;
    for (const auto& m : members) plan.world_size += m.nproc;
    for (std::size_t j = 0; j < members.size(); ++j) {
      if (members[j].index == index) break;
      ++plan.node_rank;
      plan.rank_base += members[j].nproc;
    }
    if (plan.node_rank == 0) {
      plan.master_addr = s.opt.local_addr;
      plan.master_listen_fd = net::listen_tcp(plan.master_port);
      s.store->set(round_key(r, "master"), plan.master_addr + ":" + std::to_string(plan.master_port));
    } else {
      std::optional<std::string> master;
      bool restart = false;
      while (!(master = s.store->try_get(round_key(r, "master")))) {
        s.heartbeat();
        if (s.ended() || s.lost_peer()) {
          s.end_round({.kind = RoundEnding::Kind::kMembershipChange,
                       .reason = "node rank 0 was lost before the round started"});
          restart = true;
          break;
        }
        if (Clock::now() > deadline)
          s.timed_out("node rank 0 of round " + std::to_string(r) + " never published MASTER_ADDR");
        std::this_thread::sleep_for(kPollSleep);
      }
      if (restart) {
        ++r;
        continue;
      }
      const auto colon = master->rfind(':');
      plan.master_addr = master->substr(0, colon);
      plan.master_port = std::stoi(master->substr(colon + 1));
    }
    DTRAIN_LOG(kInfo) << "round " << r << ": node rank " << plan.node_rank << " of " << plan.nnodes << ", ranks "
                      << plan.rank_base << ".." << plan.rank_base + s.opt.nproc - 1 << " of " << plan.world_size
                      << ", restarts so far " << plan.restart_count;
    return plan;
  }
}

std::optional<RoundEnding> StoreRendezvous::poll() {
  try {
    return poll_store();
  } catch (const CommunicationError& e) {
    if (!state_->failover(e.what())) throw;
    return RoundEnding{.kind = RoundEnding::Kind::kMembershipChange,
                       .reason = "the node hosting the rendezvous store was lost"};
  }
}

std::optional<RoundEnding> StoreRendezvous::poll_store() {
  auto& s = *state_;
  s.heartbeat();
  if (auto e = s.ended()) return e;
  const auto now = Clock::now();
  if (now - s.last_peer_check < s.opt.heartbeat_interval) return std::nullopt;
  s.last_peer_check = now;
  if (auto lost = s.lost_peer()) {
    return s.end_round({.kind = RoundEnding::Kind::kMembershipChange, .reason = "node " + *lost + " was lost"});
  }
  if (static_cast<int>(s.members.size()) < s.opt.max_nodes) {
    const auto waiting = s.store->try_get(round_key(s.round + 1, "joined"));
    if (waiting && std::stoll(*waiting) > 0) {
      return s.end_round({.kind = RoundEnding::Kind::kMembershipChange, .reason = "a new node is waiting to join"});
    }
  }
  return std::nullopt;
}

RoundEnding StoreRendezvous::report_failure(const WorkerExit& failure) {
  try {
    return report_to_store(failure);
  } catch (const CommunicationError& e) {
    if (!state_->failover(e.what())) throw;
    return RoundEnding{.kind = RoundEnding::Kind::kMembershipChange,
                       .reason = "the node hosting the rendezvous store was lost (here: " + failure.describe() + ")"};
  }
}

RoundEnding StoreRendezvous::report_to_store(const WorkerExit& failure) {
  auto& s = *state_;
  const auto deadline = Clock::now() + s.opt.heartbeat_timeout + 2 * s.opt.heartbeat_interval;
  while (s.members.size() > 1 && Clock::now() < deadline) {
    s.heartbeat();
    if (auto e = s.ended()) return *e;
    if (auto lost = s.lost_peer()) {
      return s.end_round({.kind = RoundEnding::Kind::kMembershipChange,
                          .reason = "node " + *lost + " was lost (here: " + failure.describe() + ")"});
    }
    std::this_thread::sleep_for(kPollSleep);
  }
  return s.end_round({.kind = RoundEnding::Kind::kFailure,
                      .reason = failure.describe(),
                      .give_up = s.restart_count >= s.opt.max_restarts,
                      .exit_code = failure.launcher_exit_code()});
}

void StoreRendezvous::finish() {
  auto& s = *state_;
  if (s.round < 0) return;
  try {
    s.store->set(round_key(s.round, "left" + std::to_string(s.my_index)), "1");
  } catch (const Error&) {
    return;  // the store is gone: nobody is left to tell
  }
  // Keep up what other members may still use until each is finished or lost:
  // the rendezvous store when this node hosts it, and the workers' store of
  // the last round when this node was its node rank 0 (Note [Worker store]
  // in agent.cpp; members are in node-rank order).
  const bool hosts_worker_store = s.members.front().index == s.my_index;
  if (!s.store->hosts_store() && !hosts_worker_store) return;
  const auto deadline = Clock::now() + s.opt.timeout;
  while (Clock::now() < deadline) {
    bool waiting = false;
    try {
      s.heartbeat();
      for (std::size_t j = 0; j < s.members.size(); ++j) {
        if (s.members[j].id != s.node_id && s.peer_status(j) == State::Peer::kAlive) waiting = true;
      }
    } catch (const Error&) {
      return;  // the rendezvous store is gone: its host leaves once all members did (or died)
    }
    if (!waiting) return;
    std::this_thread::sleep_for(kPollSleep);
  }
}

}  // namespace dtrain::elastic
