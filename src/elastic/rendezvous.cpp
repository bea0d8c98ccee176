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
// Note [Store-host failover] (design; not implemented yet, issue 15 item 3)
// Today the store lives in the process of the node the endpoint names, and
// losing that node ends the job ("lost the rendezvous store"). The plan:
// - Generations. Keys move under dtrain/rdzv/g<G>/; the first store is G=0.
//   Every node caches the last closed round it was a member of: its number,
//   restart count, and the members' records (id, address, node rank), which
//   every member already reads when the round closes.
// - Successor. When a store operation fails (connection reset, or no answer
//   within the heartbeat timeout), each surviving member walks the cached
//   members in node-rank order, skipping the old host: the first candidate
//   that answers on its address at the endpoint's port is the new host; a
//   node that reaches no lower candidate within a heartbeat timeout hosts
//   generation G+1 itself, seeded with run id, --nnodes, G+1, and the cached
//   round and restart count. Candidates that have not hosted refuse
//   connections, so a node can never join a store of the wrong generation.
// - Quorum (no split brain). The first round of G+1 closes only with at least
//   MIN nodes and more than half of the cached round's members. Under a
//   partition at most one side holds a strict majority, so at most one side
//   goes on; a side below MIN or without a majority stops with an error
//   naming the lost nodes, never trains alone. Consequence: a 2-node job
//   whose store host dies stops (1 of 2 is no majority) unless
//   --rdzv-conf failover_quorum=min trades that guarantee for availability
//   (safe whenever MIN > N/2, where the two conditions coincide).
// - The round after a failover is a membership change: it uses no restart,
//   and training resumes from the last checkpoint as after any lost node.
//   The workers' store needs nothing new: node rank 0 of each round hosts it.
// - Joining later. New nodes know only --rdzv-endpoint, the old host. Either
//   the endpoint is a name that follows the host (a Kubernetes Service, a
//   DNS name), or --rdzv-endpoint takes a list, tried in order, and each
//   generation's host also answers there. A node that comes back from a
//   partition with a stale generation reads the newer one from any member it
//   reaches and rejoins as a new arrival.
// - Authentication carries over: the new host gates its store with the same
//   secret (Note [Rendezvous authentication]).
#include "dtrain/elastic/rendezvous.h"

#include "../core/net.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
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
    int r = 0;
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
  s.heartbeat(/*force=*/true);
  int r = s.next_round;
  if (r < 0) {
    r = s.newest_round();
    if (s.exists(round_key(r, "closed"))) ++r;
  }
  for (;;) {
    auto deadline = Clock::now() + s.opt.timeout;
    const int index = static_cast<int>(s.store->add(round_key(r, "joined"), 1)) - 1;
    s.store->set(
        round_key(r, "node" + std::to_string(index)),
        nlohmann::json{
            {"id", s.node_id}, {"addr", s.opt.local_addr}, {"nproc", s.opt.nproc}, {"node_rank", s.opt.node_rank}}
            .dump());
    DTRAIN_LOG(kInfo) << "node " << s.node_id << " joined rendezvous round " << r << " at " << s.opt.endpoint
                      << " (arrival " << index << ")";
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
      const bool enough =
          count >= s.opt.max_nodes || (count >= s.opt.min_nodes && Clock::now() - last_change >= s.opt.last_call);
      if (previous_over && enough) {
        s.store->set(round_key(r, "restarts"), std::to_string(s.restarts_for(r)));
        s.store->create_if_absent(round_key(r, "closed"),
                                  std::to_string(std::min<std::int64_t>(count, s.opt.max_nodes)));
        continue;
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

    // The members, in node-rank order.
    std::vector<NodeRecord> members;
    for (int i = 0; i < closed; ++i) {
      std::optional<std::string> rec;
      while (!(rec = s.store->try_get(round_key(r, "node" + std::to_string(i))))) {
        if (Clock::now() > deadline)
          s.timed_out("arrival " + std::to_string(i) + " of round " + std::to_string(r) + " never registered");
        std::this_thread::sleep_for(kPollSleep);
      }
      const auto j = nlohmann::json::parse(*rec);
      members.push_back(
          {.index = i, .id = j.at("id"), .addr = j.at("addr"), .nproc = j.at("nproc"), .node_rank = j.at("node_rank")});
    }
    std::stable_sort(members.begin(), members.end(), [](const NodeRecord& a, const NodeRecord& b) {
      return (a.node_rank < 0 ? INT_MAX : a.node_rank) < (b.node_rank < 0 ? INT_MAX : b.node_rank);
    });
    s.round = r;
    s.next_round = r + 1;
    s.members = members;
    s.my_index = index;
    s.track_peers();
    s.restart_count = std::stoi(s.store->try_get(round_key(r, "restarts")).value_or("0"));

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
  s.store->set(round_key(s.round, "left" + std::to_string(s.my_index)), "1");
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
