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
// Store-host failover: see Note [Store-host failover] in failover.cpp. The
// rendezvous keeps what a node knows (the known round, lost hosts,
// acquaintances), drives the Failover machine when its store is lost
// (State::failover), and runs the FirstRoundGate while the first round of a
// failover store forms and before it closes.
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
#include "failover.h"
#include "rendezvous_keys.h"

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

using detail::decode;
using detail::encode;
using detail::key;
using detail::round_key;

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
  std::string record;  // as stored (JSON)
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
  int generation = 0;   // stores hosted so far after the first (Note [Store-host failover])
  std::string where;    // the current store's address, for messages (the endpoint until a failover)
  std::string host_id;  // who hosts the current store ("": the first store, whose host's record says so)
  // The last closed round this node knows (as a member, or the one before the
  // round it waits in): who would host the next generation.
  int known_round = -1;
  int known_restarts = 0;
  std::vector<NodeRecord> known_members;   // in node-rank order
  std::vector<std::string> lost_hosts;     // ids of store hosts known lost
  std::vector<std::string> acquaintances;  // addresses seen in rounds: where competing stores may be
  std::optional<std::string> moved_to;     // the current store yielded to the one at this address

  void remember(const std::string& addr) {
    if (std::find(acquaintances.begin(), acquaintances.end(), addr) == acquaintances.end()) {
      acquaintances.push_back(addr);
    }
  }
  detail::FailoverNet net();
  // Whether round r is the first of a failover store (its FirstRoundGate decides whether it closes).
  bool gated(int r) { return generation > 0 && r == first_round(); }
  // Runs the gate's sweep to the end and, when `close`, settles the first
  // round as closed; false when the store yielded instead (moved_to set).
  bool sweep(detail::FirstRoundGate& gate, bool close);
  // Stores this node hosted and then yielded: kept up so that their nodes read where they moved.
  std::vector<std::shared_ptr<RendezvousStore>> retired;

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

  // Note [Store-host failover]: after the store's host was lost (or the store
  // yielded: moved_to), moves to the store that follows it, hosting it when
  // this node is the first live member of its view; false when this node never
  // was a member (it knows no one) or nothing was found within --rdzv-timeout.
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
    throw TimeoutError("rendezvous at " + where + " (run '" + opt.run_id + "'): " + what + " within " +
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
                   .hosts = j.value("hosts", false),
                   .record = *rec});
    remember(out.back().addr);
  }
  std::stable_sort(out.begin(), out.end(), [](const NodeRecord& a, const NodeRecord& b) {
    return (a.node_rank < 0 ? INT_MAX : a.node_rank) < (b.node_rank < 0 ? INT_MAX : b.node_rank);
  });
  return out;
}

detail::FailoverNet StoreRendezvous::State::net() {
  // Probes of other nodes are short (an address with no store costs the whole
  // probe): a candidate that is not up yet gets more tries.
  const auto probe = std::max(opt.heartbeat_interval, std::chrono::milliseconds(1000));
  auto connect = [this, probe](const std::string& addr) -> std::shared_ptr<RendezvousStore> {
    try {
      return opt.reconnect(addr, opt.port, /*host_it=*/false, probe);
    } catch (const std::exception&) {
      return nullptr;
    }
  };
  auto host = [this]() -> std::shared_ptr<RendezvousStore> {
    retired.clear();  // a store this node yielded holds the port
    try {
      return opt.reconnect(opt.local_addr, opt.port, /*host_it=*/true, opt.heartbeat_timeout);
    } catch (const std::exception&) {
      return nullptr;  // the port may stay bound for a moment after its holder died
    }
  };
  return {.connect = connect, .host = host};
}

bool StoreRendezvous::State::sweep(detail::FirstRoundGate& gate, bool close) {
  gate.begin();
  for (;;) {
    heartbeat();
    switch (gate.step()) {
      case detail::FirstRoundGate::Status::kProbing: continue;
      case detail::FirstRoundGate::Status::kClear:
        if (!close || gate.settle()) return true;
        [[fallthrough]];
      case detail::FirstRoundGate::Status::kYield: moved_to = gate.moved_to(); return false;
    }
  }
}

bool StoreRendezvous::State::failover(const std::string& why) {
  if (!opt.reconnect || known_round < 0 || known_members.empty()) return false;
  const bool moving = moved_to.has_value();
  if (!moving) {  // the host is lost: never a candidate again
    if (!host_id.empty()) lost_hosts.push_back(host_id);
    for (const NodeRecord& m : members) {
      if (host_id.empty() && m.hosts) lost_hosts.push_back(m.id);
    }
    for (const NodeRecord& m : known_members) {
      if (host_id.empty() && m.hosts) lost_hosts.push_back(m.id);
    }
  }
  detail::FailoverView view{.round = known_round,
                            .restarts = known_restarts,
                            .generation = generation,
                            .lost_hosts = lost_hosts,
                            .acquaintances = acquaintances};
  for (const NodeRecord& m : known_members) view.members.push_back({.id = m.id, .addr = m.addr, .record = m.record});
  const std::string port = ":" + std::to_string(opt.port);
  detail::Failover seek(view,
                        {.node_id = node_id,
                         .addr = opt.local_addr,
                         .port_suffix = port,
                         .run_id = opt.run_id,
                         .min_nodes = opt.min_nodes,
                         .max_nodes = opt.max_nodes,
                         .quorum_min = opt.failover_quorum_min},
                        net());
  if (moving) {
    if (store->hosts_store()) retired.push_back(store);
    DTRAIN_LOG(kWarning) << "the rendezvous store at " << where << " yielded to the one at " << *moved_to << port
                         << "; following it";
    seek.follow(*moved_to);
    moved_to.reset();
  } else {
    DTRAIN_LOG(kWarning) << "lost the rendezvous store at " << where << " (" << why.substr(0, why.find('\n'))
                         << "); moving to generation " << generation + 1
                         << ", hosted by the first live member of round " << known_round
                         << " in node-rank order (or a store that outranks it)";
  }
  // A candidate gets two heartbeat timeouts (to notice the loss) and a last
  // call (to host) before the next one is tried; the whole search, --rdzv-timeout.
  const auto patience = 2 * opt.heartbeat_timeout + opt.last_call;
  const auto deadline = Clock::now() + opt.timeout;
  auto candidate_since = Clock::now();
  std::string last_problem, target = seek.target();
  for (;;) {
    const auto status = seek.step();
    if (status == detail::Failover::Status::kGaveUp) break;
    if (status != detail::Failover::Status::kSeeking) {
      store = seek.store();
      generation = seek.facts().standing.generation;
      host_id = seek.facts().host_id;
      where = seek.where();
      next_round = seek.facts().first_round;
      remember(seek.facts().addr);
      DTRAIN_LOG(kInfo) << (status == detail::Failover::Status::kHosting ? "hosting" : "joined")
                        << " the rendezvous store of generation " << generation << " at " << where
                        << " (failover; seeded from round " << seek.facts().standing.view << ")";
      return true;
    }
    if (seek.target() != target) {
      target = seek.target();
      candidate_since = Clock::now();
    }
    if (seek.last_problem() != last_problem) {
      last_problem = seek.last_problem();
      DTRAIN_LOG(kInfo) << "failover: " << last_problem;
    }
    if (Clock::now() - candidate_since > patience) {
      seek.give_up_on_candidate();
      candidate_since = Clock::now();
    }
    if (Clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  DTRAIN_LOG(kWarning) << "failover found no store to go on with within " << log::format_seconds(opt.timeout)
                       << (last_problem.empty() ? "" : " (last: " + last_problem + ")");
  return false;
}

StoreRendezvous::StoreRendezvous(std::shared_ptr<RendezvousStore> store, StoreRendezvousOptions options)
    : state_(std::make_unique<State>()) {
  auto& s = *state_;
  s.store = std::move(store);
  s.opt = std::move(options);
  s.node_id = make_node_id();
  s.where = s.opt.endpoint;
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
  s.host_id = s.store->try_get(key("host_id")).value_or("");
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
    DTRAIN_LOG(kInfo) << "node " << s.node_id << " joined rendezvous round " << r << " at " << s.where << " (arrival "
                      << index << ")";
    // A node that was never a member learns who would host after a failover
    // from the round before this one (after a failover: the round the store
    // was seeded from, records included).
    if (s.known_round < r - 1 && r > 0) {
      if (const auto c = s.store->try_get(round_key(r - 1, "closed"))) {
        s.known_members = s.read_members(r - 1, std::stoi(*c), deadline);
        s.known_round = r - 1;
        s.known_restarts = std::stoi(s.store->try_get(round_key(r - 1, "restarts")).value_or("0"));
      }
    }
    std::int64_t last_count = -1;
    auto last_change = Clock::now();
    auto last_sweep = Clock::now();
    int closed = -1;
    // The first round of a failover store closes only past its gate; until
    // then, sweeps find competing stores (Note [Store-host failover]).
    std::optional<detail::FirstRoundGate> gate;
    if (s.gated(r)) gate.emplace(s.store, s.acquaintances, s.net(), s.opt.local_addr);
    auto yielded = [&] {
      throw CommunicationError("the rendezvous store at " + s.where + " yielded to the one at " + *s.moved_to,
                               "its nodes follow it (Note [Store-host failover])");
    };
    while (closed < 0) {
      s.heartbeat();
      if (auto c = s.store->try_get(round_key(r, "closed"))) {
        closed = std::stoi(*c);
        break;
      }
      if (gate && Clock::now() - last_sweep >= s.opt.heartbeat_interval) {
        last_sweep = Clock::now();
        if (!s.sweep(*gate, /*close=*/false)) yielded();
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
        if (gate && !s.sweep(*gate, /*close=*/true)) yielded();  // a fresh sweep, right before closing
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
