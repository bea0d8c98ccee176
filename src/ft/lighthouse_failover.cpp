// The client's side of the lighthouse failover: its candidates, and the
// move to the next one when its lighthouse is lost
// (include/dtrain/ft/lighthouse.h; the standby is src/ft/standby_lighthouse.cpp).
//
// Note [Lighthouse failover]
// The lighthouse lives in node 0's launcher; without a failover, node 0's
// death stopped every group. With `dtrain run --ft-lighthouse-standby
// HOST:PORT` (on every node), node 1's launcher keeps a standby
// (StandbyLighthouse) that watches node 0's liveness counter (ft/alive)
// and, once it has not moved for the failover timeout, serves a fresh
// lighthouse at HOST:PORT. Every worker is given both addresses in advance,
// in order (DTRAIN_FT_LIGHTHOUSE=node0:port,HOST:PORT). What makes the move
// safe:
// - Soft state. The lighthouse keeps registrations, heartbeats and requests
//   only; the standby rebuilds them from the clients, which register again
//   (a new incarnation) and ask again with their step.
// - Ids that never go back. Every request carries its replica's last round
//   and quorum id and the newest step of its last quorum; a lighthouse
//   raises its own counters above them (and its newest step to it) before
//   answering, so no pg/<quorum id> or commit/<round> is ever handed out
//   twice, a group's cached process group (kept while the quorum id stays)
//   is never taken for a new one, and no quorum forms from groups all
//   behind the newest step the old lighthouse saw.
// - A fresh group. A client that moved asks for a fresh group: the one it
//   made in the lost store is gone with it.
// - A vote in flight is an abort for whoever did not read its decision:
//   no member applies a step whose decision it did not read, so a member
//   that read "commit" is ahead and the others recover from it.
// - Every rank of a group. Only a group's rank 0 talks to the lighthouse;
//   with each quorum it tells the group's other ranks which candidate it is
//   connected to and after how many connections, and they connect there
//   too (follow()), so all make the quorum's group in the same store, also
//   when the lighthouse came back fresh at the same address.
// - Bounded. A client looks for a serving candidate for failover_timeout,
//   each try bounded by candidate_timeout, and fails with every candidate
//   named otherwise; its heartbeat thread stops while it looks (the lost
//   lighthouse's peers see it silent, as they would see it dead).
// "Serving" means: the candidate's store answers and holds a lighthouse
// (ft/heartbeat_timeout_ms, written when its service starts) that has not
// stopped (ft/failed). The standby's port is bound from the start but
// answers no one until it takes over, so a client never joins it early.
// Limits (docs/fault_tolerance.md): one standby (if node 1 dies too, the
// job stops); node 0's groups are lost with it and recover from a peer once
// node 0 is started again (its launcher then finds the standby serving and
// hosts none); a cut between node 0 and node 1 longer than the failover
// timeout, with both alive, makes two lighthouses (the standby's quorums
// then hold node 1's groups only).
#include <c10/util/Logging.h>

#include <algorithm>
#include <thread>

#include "dtrain/error.h"
#include "dtrain/ft/lighthouse.h"
#include "dtrain/log.h"

namespace dtrain::ft {

// Note [Timed-out waits and reverse DNS]
// c10d logs a warning for every store wait that times out, and formats it
// with the socket's addresses through getnameinfo, a reverse DNS lookup for
// an address /etc/hosts does not list (a v4-mapped ::ffff:127.0.0.1, as on
// a socket the launcher binds). The client's and the lighthouse's waits
// time out by design (slices of 5-500 ms); here that made hundreds of
// lookups a second, and a throttled DNS server stalled the standby's
// service 5 s per lookup (FtFailover tests, 2026-11-25: clients saw it
// "not moving" and left it). Only errors are logged from c10d in processes
// that talk to a lighthouse, as the launcher already does.
void quiet_c10d_warnings() {
  FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, 2);
}

bool lighthouse_serves(const LighthouseAddress& address, std::chrono::milliseconds timeout) {
  try {
    dist::Store store = connect_lighthouse(address.host, address.port, timeout).with_prefix("ft");
    return store.check({"heartbeat_timeout_ms"}) && !store.check({"failed"});
  } catch (const std::exception&) {
    return false;  // nothing answers there (yet)
  }
}

LighthouseClient::LighthouseClient(std::vector<LighthouseAddress> candidates, LighthouseClientOptions options)
    : store_(nullptr), heartbeat_store_(nullptr), options_(options), candidates_(std::move(candidates)) {
  DTRAIN_CHECK(options_.replica_id >= 0, ConfigError, "replica id " << options_.replica_id << " is negative.",
               "number replica groups 0, 1, ...");
  quiet_c10d_warnings();  // Note [Timed-out waits and reverse DNS]
  DTRAIN_CHECK(!candidates_.empty(), ConfigError,
               "replica " << options_.replica_id << ": no lighthouse address to connect to.",
               "give at least one HOST:PORT (DTRAIN_FT_LIGHTHOUSE)");
  // The first that serves: node 0's at the start; the standby when a
  // replica group starts after node 0 was lost.
  current_ = candidates_.size() - 1;
  reconnect("");
}

bool LighthouseClient::connect(std::size_t index) {
  const LighthouseAddress& at = candidates_[index];
  if (!lighthouse_serves(at, options_.candidate_timeout)) return false;
  try {
    // Its own connections, with the usual timeout for the group's rendezvous.
    store_ = connect_lighthouse(at.host, at.port).with_prefix("ft");
    heartbeat_store_ = connect_lighthouse(at.host, at.port).with_prefix("ft");
  } catch (const std::exception&) {
    return false;
  }
  current_ = index;
  ++connections_;
  return true;
}

void LighthouseClient::reconnect(const std::string& why_in_full) {
  // c10d's messages carry a backtrace: their first line says it.
  const std::string why = why_in_full.substr(0, why_in_full.find('\n'));
  const std::string who = "replica " + std::to_string(options_.replica_id);
  const bool first = why.empty();
  if (!first) {
    DTRAIN_LOG(kWarning) << who << ": lost the lighthouse at " << candidates_[current_].to_string() << " (" << why
                         << "); looking for the next one that serves";
  }
  stop_heartbeat();
  incarnation_ = 0;  // registers again with the next one
  asked_.reset();
  peer_heartbeat_timeout_ = std::chrono::milliseconds(0);
  const auto start = std::chrono::steady_clock::now();
  const std::size_t n = candidates_.size();
  for (std::size_t tries = 1;; ++tries) {
    // The next candidates in order, the lost one last (a transient failure).
    const std::size_t index = (current_ + tries) % n;
    if (connect(index)) {
      if (!first) {
        DTRAIN_LOG(kWarning) << who << ": reconnected to the lighthouse at " << candidates_[index].to_string()
                             << " after "
                             << log::format_seconds(std::chrono::duration_cast<std::chrono::milliseconds>(
                                    std::chrono::steady_clock::now() - start));
      }
      return;
    }
    if (std::chrono::steady_clock::now() - start >= options_.failover_timeout) break;
    if (tries % n == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::string all;
  for (const auto& c : candidates_) all += (all.empty() ? "" : ", ") + c.to_string();
  throw CommunicationError(who + (first ? ": found" : ": lost the lighthouse (" + why + ") and then found") +
                               " no lighthouse serving at " + all + " within " +
                               log::format_seconds(options_.failover_timeout) + ".",
                           "check that node 0's launcher (or, after its loss, the standby's on node 1: dtrain run "
                           "--ft-lighthouse-standby) is running; with both gone, restart the job from its "
                           "checkpoints");
}

void LighthouseClient::follow(std::size_t index, std::int64_t connections) {
  // Rank 0 (registered: it talks to the lighthouse) never follows; a
  // follower's own connects do not count (connections_ is rank 0's count).
  if (candidates_.empty() || incarnation_ != 0 || connections == followed_) return;
  // Both made their first connection to the same candidate: nothing to do.
  if (followed_ == 0 && connections == 1 && index == current_) {
    followed_ = connections;
    return;
  }
  DTRAIN_INTERNAL_ASSERT(index < candidates_.size(), "replica " << options_.replica_id << ": lighthouse candidate "
                                                                << index << " of " << candidates_.size());
  const auto start = std::chrono::steady_clock::now();
  while (!connect(index)) {
    DTRAIN_CHECK(std::chrono::steady_clock::now() - start < options_.failover_timeout, CommunicationError,
                 "replica " << options_.replica_id << ": this group's rank 0 moved to the lighthouse at "
                            << candidates_[index].to_string() << ", which does not answer this rank within "
                            << log::format_seconds(options_.failover_timeout) << ".",
                 "check the network between this node and " << candidates_[index].host);
  }
  followed_ = connections;
  DTRAIN_LOG(kInfo) << "replica " << options_.replica_id << ": follows its group's rank 0 to the lighthouse at "
                    << candidates_[index].to_string();
}

}  // namespace dtrain::ft
