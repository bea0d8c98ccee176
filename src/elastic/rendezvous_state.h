// Private: what a StoreRendezvous keeps between calls -- the current round
// and its members' heartbeats (Note [Rendezvous protocol] in rendezvous.cpp),
// and what this node knows for a store-host failover (Note [Store-host
// failover] in failover.cpp). rendezvous.cpp forms rounds with it;
// rendezvous_failover.cpp moves it to the store that follows a lost one.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/elastic/rendezvous.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "failover.h"
#include "rendezvous_keys.h"

namespace dtrain::elastic {
namespace detail {

using Clock = std::chrono::steady_clock;
inline constexpr auto kPollSleep = std::chrono::milliseconds(20);

struct NodeRecord {
  int index = 0;  // arrival index
  std::string id;
  std::string addr;
  int nproc = 1;
  int node_rank = -1;
  bool hosts = false;  // hosted the store when it joined
  std::string record;  // as stored (JSON)
};

}  // namespace detail

struct StoreRendezvous::State {
  std::shared_ptr<RendezvousStore> store;
  StoreRendezvousOptions opt;
  std::string node_id;
  int next_round = -1;  // -1: never joined
  // The current round.
  int round = -1;
  int restart_count = 0;
  int my_index = -1;
  std::vector<detail::NodeRecord> members;  // in node-rank order
  std::vector<std::int64_t> peer_beat;
  std::vector<detail::Clock::time_point> peer_seen;
  detail::Clock::time_point last_heartbeat{};
  detail::Clock::time_point last_peer_check{};
  int generation = 0;   // stores hosted so far after the first (Note [Store-host failover])
  std::string where;    // the current store's address, for messages (the endpoint until a failover)
  std::string host_id;  // who hosts the current store ("": the first store, whose host's record says so)
  // The last closed round this node knows (as a member, or the one before the
  // round it waits in): who would host the next generation.
  int known_round = -1;
  int known_restarts = 0;
  std::vector<detail::NodeRecord> known_members;  // in node-rank order
  std::vector<std::string> lost_hosts;            // ids of store hosts known lost
  std::vector<std::string> acquaintances;         // addresses seen in rounds: where competing stores may be
  std::optional<std::string> moved_to;            // the current store yielded to the one at this address

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
  std::vector<detail::NodeRecord> read_members(int r, int closed, detail::Clock::time_point deadline);

  // The first round of this store's generation (0 for the first store).
  int first_round() {
    const auto v = store->try_get(detail::key("first_round"));
    return v ? std::stoi(*v) : 0;
  }

  // Nodes the first round of a generation needs besides MIN (0: none).
  int quorum_for(int r) {
    if (r != first_round()) return 0;
    const auto v = store->try_get(detail::key("quorum"));
    return v ? std::stoi(*v) : 0;
  }

  // Note [Store-host failover]: after the store's host was lost (or the store
  // yielded: moved_to), moves to the store that follows it, hosting it when
  // this node is the first live member of its view; false when this node never
  // was a member (it knows no one) or nothing was found within --rdzv-timeout.
  bool failover(const std::string& why);

  void heartbeat(bool force = false) {
    const auto now = detail::Clock::now();
    if (!force && now - last_heartbeat < opt.heartbeat_interval) return;
    store->add(detail::key("hb/" + node_id), 1);
    last_heartbeat = now;
  }

  bool exists(const std::string& k) { return store->try_get(k).has_value(); }

  std::optional<RoundEnding> ended() {
    if (auto v = store->try_get(detail::round_key(round, "end"))) return detail::decode(*v);
    return std::nullopt;
  }

  RoundEnding end_round(const RoundEnding& mine) {
    return detail::decode(store->create_if_absent(detail::round_key(round, "end"), detail::encode(mine)));
  }

  enum class Peer { kAlive, kDone, kLost };
  Peer peer_status(std::size_t j) {
    if (members[j].id == node_id) return Peer::kAlive;
    if (exists(detail::round_key(round, "left" + std::to_string(members[j].index)))) return Peer::kDone;
    const auto v = store->try_get(detail::key("hb/" + members[j].id));
    const std::int64_t beat = v ? std::stoll(*v) : 0;
    const auto now = detail::Clock::now();
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
    peer_seen.assign(members.size(), detail::Clock::now());
  }

  // The newest round that has arrivals.
  int newest_round() {
    int r = first_round();
    while (exists(detail::round_key(r + 1, "joined"))) ++r;
    return r;
  }

  // Restart count of round r: that of the newest closed round before it,
  // plus one if that round ended in a failure.
  int restarts_for(int r) {
    for (int q = r - 1; q >= 0; --q) {
      if (!exists(detail::round_key(q, "closed"))) continue;
      const auto rc = store->try_get(detail::round_key(q, "restarts"));
      const auto end = store->try_get(detail::round_key(q, "end"));
      const int base = rc ? std::stoi(*rc) : 0;
      return base + (end && detail::decode(*end).kind == RoundEnding::Kind::kFailure ? 1 : 0);
    }
    return 0;
  }

  [[noreturn]] void timed_out(const std::string& what) {
    throw TimeoutError("rendezvous at " + where + " (run '" + opt.run_id + "'): " + what + " within " +
                           log::format_seconds(opt.timeout) + ".",
                       "start the other nodes with the same --rdzv-endpoint and --rdzv-id, or raise --rdzv-timeout");
  }
};

}  // namespace dtrain::elastic
