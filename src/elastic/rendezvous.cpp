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
// acquaintances; rendezvous_state.h), drives the Failover machine when its
// store is lost (State::failover, in rendezvous_failover.cpp), and runs the
// FirstRoundGate while the first round of a failover store forms and before
// it closes.
#include "dtrain/elastic/rendezvous.h"

#include "dtrain/net.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "dtrain/elastic/agent.h"
#include "rendezvous_state.h"

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

using detail::Clock;
using detail::decode;
using detail::encode;
using detail::key;
using detail::kPollSleep;
using detail::NodeRecord;
using detail::round_key;

std::string make_node_id() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::random_device rd;
  char suffix[16];
  std::snprintf(suffix, sizeof suffix, "%04x", static_cast<unsigned>(rd() & 0xffff));
  return std::string(host) + ":" + std::to_string(::getpid()) + ":" + suffix;
}

}  // namespace

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
