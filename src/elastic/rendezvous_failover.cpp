// The failover path of StoreRendezvous (Note [Store-host failover] in
// failover.cpp): the probes and hosting it lends the Failover and
// FirstRoundGate machines, the gate's sweeps, and the move to the store that
// follows a lost (or yielded) one.
#include <algorithm>
#include <thread>

#include "rendezvous_state.h"

namespace dtrain::elastic {

using detail::Clock;
using detail::NodeRecord;

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

}  // namespace dtrain::elastic
