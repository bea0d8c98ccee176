// A replica group's side of the lighthouse (include/dtrain/ft/lighthouse.h;
// the keys are in Note [Quorum protocol], src/ft/lighthouse.cpp).
//
// Note [Commit vote]
// A step commits only if every member of its quorum finished its gradient
// all-reduce: a member that failed (or died) mid-step must not leave the
// others with an update it never applied, nor apply half of one itself.
// Each member votes with one add on commit/<round>/votes: 1 for ok,
// 1 + 2^32 for abort, so the sum it gets back counts the votes so far in
// its low 32 bits and the aborts among them in its high bits. Then it
// proposes a decision through compare_set on commit/<round>/decision, which
// keeps the first proposal: "abort" when the sum shows an abort (its own or
// an earlier voter's), "commit" when it is the last voter (the sum counts
// every member) and none aborted; any other voter waits for the decision,
// and proposes "abort" if none is there within commit_timeout (a dead
// member never votes). Every member then acts on the stored decision, so
// all commit or none do, even when a late voter finds every vote in after
// the others timed out on it. A member that dies after voting is simply
// behind at the next quorum and recovers from a peer. Two or three round
// trips per member: the add, then the proposal, or the wait and the read.
#include <algorithm>
#include <sstream>

#include "dtrain/comm/store_keys.h"
#include "dtrain/error.h"
#include "dtrain/ft/lighthouse.h"
#include "dtrain/log.h"

namespace dtrain::ft {

LighthouseEndpoint lighthouse_from_env(const dist::EnvLookup& env) {
  const auto get = [&env](const char* name) {
    const auto value = env(name);
    DTRAIN_CHECK(value.has_value() && !value->empty(), ConfigError,
                 name << " is not set: this program trains as a fault-tolerant replica group.",
                 "start it with dtrain run --ft-replicas N, which hosts the lighthouse and sets it");
    return *value;
  };
  LighthouseEndpoint e;
  e.candidates = parse_lighthouse_addresses("DTRAIN_FT_LIGHTHOUSE", get("DTRAIN_FT_LIGHTHOUSE"));
  e.replicas = dist::detail::parse_int("DTRAIN_FT_REPLICAS", get("DTRAIN_FT_REPLICAS"), 1, 1 << 16);
  e.replica_id = dist::detail::parse_int("DTRAIN_FT_REPLICA_ID", get("DTRAIN_FT_REPLICA_ID"), 0, e.replicas - 1);
  return e;
}

bool launched_fault_tolerant(const dist::EnvLookup& env) {
  const auto value = env("DTRAIN_FT_LIGHTHOUSE");
  return value.has_value() && !value->empty();
}

LighthouseClient::LighthouseClient(dist::Store store, dist::Store heartbeat_store, LighthouseClientOptions options)
    : store_(store.with_prefix("ft")), heartbeat_store_(heartbeat_store.with_prefix("ft")), options_(options) {
  DTRAIN_CHECK(options_.replica_id >= 0, ConfigError, "replica id " << options_.replica_id << " is negative.",
               "number replica groups 0, 1, ...");
}

LighthouseClient::~LighthouseClient() {
  stop_heartbeat();
  if (seq_ > 0) {
    // Its cost, for docs/fault_tolerance.md's "Store round trips per step"
    // (heartbeats, on their own connection, not included).
    DTRAIN_LOG(kInfo) << "replica " << options_.replica_id << ": " << seq_ << " quorum requests, "
                      << dist::round_trips(store_) << " store round trips on its connection";
  }
}

void LighthouseClient::register_once() {
  if (incarnation_ != 0) return;
  incarnation_ = store_.add("nreg", 1);
  heartbeat_store_.add("hb/" + std::to_string(incarnation_), 1);
  store_.set("reg/" + std::to_string(incarnation_), std::to_string(options_.replica_id));
  heartbeat_ = std::thread([this, identity = log::identity()] {
    log::ScopedIdentity as(identity);
    beat();
  });
}

void LighthouseClient::stop_heartbeat() {
  stop_ = true;
  if (heartbeat_.joinable()) heartbeat_.join();
  stop_ = false;
}

void LighthouseClient::beat() {
  const std::string key = "hb/" + std::to_string(incarnation_);
  bool warned = false;
  while (!stop_) {
    try {
      heartbeat_store_.add(key, 1);
      warned = false;
    } catch (const std::exception& e) {
      if (!warned) {
        DTRAIN_LOG(kWarning) << "replica " << options_.replica_id << ": heartbeat failed: " << e.what();
      }
      warned = true;
    }
    // Short sleeps, so the destructor does not wait out a whole interval.
    const auto until = std::chrono::steady_clock::now() + options_.heartbeat_interval;
    while (!stop_ && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

void LighthouseClient::check_lighthouse_alive(std::int64_t& alive, std::chrono::steady_clock::time_point& moved_at) {
  const auto now = std::chrono::steady_clock::now();
  const std::string who = "replica " + std::to_string(options_.replica_id);
  if (store_.check({"failed"})) {
    throw CommunicationError(who + ": the lighthouse stopped serving: " + store_.get("failed"),
                             "a bug in the lighthouse: report it with the launcher's log; restart the job (from a "
                             "checkpoint)");
  }
  const std::int64_t now_alive = store_.add("alive", 0);
  if (now_alive != alive) {
    alive = now_alive;
    moved_at = now;
  } else if (now - moved_at >= options_.lighthouse_timeout) {
    throw CommunicationError(
        who + ": the lighthouse has not moved for " +
            log::format_seconds(std::chrono::duration_cast<std::chrono::milliseconds>(now - moved_at)) +
            " (its store answers, its service does not).",
        "the launcher's lighthouse thread is stuck or gone: check the launcher's log; "
        "restart the job (from a checkpoint)");
  }
}

void LighthouseClient::withdraw_or_wait(const std::string& id) {
  // Withdraw the request unless the lighthouse has claimed it: then its
  // answer is on the way (Note [Quorum protocol]), or the claim is released
  // again (the quorum fell through) and the next try withdraws.
  const std::string answer = "answer/" + id;
  const auto start = std::chrono::steady_clock::now();
  const auto slice =
      std::clamp(options_.lighthouse_timeout / 10, std::chrono::milliseconds(5), std::chrono::milliseconds(100));
  for (;;) {
    if (store_.compare_set("claim/" + id, "", "withdrawn") == "withdrawn") {
      throw TimeoutError("replica " + std::to_string(options_.replica_id) +
                             " got no quorum from the lighthouse within " +
                             log::format_seconds(options_.quorum_timeout) + ".",
                         "check that at least the lighthouse's min_replicas replica groups are up (dtrain run "
                         "--ft-min-replicas), and that one of them holds the newest step");
    }
    try {
      store_.wait({answer}, slice);
      return;
    } catch (const TimeoutError&) {
    }
    if (std::chrono::steady_clock::now() - start >= options_.lighthouse_timeout) {
      throw CommunicationError("replica " + std::to_string(options_.replica_id) +
                                   ": the lighthouse claimed its quorum request but has not answered it within " +
                                   log::format_seconds(options_.lighthouse_timeout) + ".",
                               "the launcher's lighthouse thread is stuck or gone: check the launcher's log; "
                               "restart the job (from a checkpoint)");
    }
  }
}

void LighthouseClient::ask(std::int64_t step, bool fresh_group) {
  register_once();
  const std::string k = std::to_string(incarnation_);
  // The floors last: a lighthouse that took over starts its ids above them
  // (Note [Lighthouse failover]).
  const std::string join = std::to_string(++seq_) + " " + std::to_string(step) + " " + (fresh_group ? "1" : "0") + " " +
                           std::to_string(last_quorum_id_) + " " + std::to_string(last_round_) + " " +
                           std::to_string(newest_step_);
  // The wake-up carries the request (Note [Quorum protocol]); both keys in
  // one round trip after the count.
  const std::string event = "ev/" + std::to_string(store_.add("nev", 1));
  dist::multi_set(store_, {"join/" + k, event}, {join, k + " " + join});
  asked_ = Asked{.step = step, .fresh_group = fresh_group};
}

void LighthouseClient::ask_ahead(std::int64_t step) {
  DTRAIN_INTERNAL_ASSERT(!asked_, "replica " << options_.replica_id << " asked ahead twice");
  if (lost_) return;  // quorum() reconnects and asks
  try {
    ask(step, false);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    if (candidates_.empty()) throw;
    lost_ = e.what();  // the lighthouse's store is gone: quorum() asks the next one
    asked_.reset();
  }
}

Quorum LighthouseClient::quorum(std::int64_t step, bool fresh_group) {
  if (asked_) {
    DTRAIN_INTERNAL_ASSERT(asked_->step == step && asked_->fresh_group == fresh_group,
                           "replica " << options_.replica_id << " asked ahead at step " << asked_->step
                                      << " and now asks at step " << step << (fresh_group ? " for a fresh group" : ""));
  }
  for (;;) {
    if (lost_) {
      reconnect(*lost_);
      lost_.reset();
      fresh_group = true;  // the group made in the lost store is gone with it
    }
    try {
      Quorum q = quorum_once(step, fresh_group);
      last_round_ = q.round;
      last_quorum_id_ = q.quorum_id;
      newest_step_ = std::max(newest_step_, q.max_step());
      return q;
    } catch (const TimeoutError&) {
      throw;  // the quorum timeout: no quorum, though the lighthouse serves
    } catch (const RendezvousError&) {
      throw;  // the end of training, or its newest state lost
    } catch (const InternalError&) {
      throw;
    } catch (const std::exception& e) {
      // Its store failed (the launcher hosting it died), or its service
      // stopped (CommunicationError): Note [Lighthouse failover].
      if (candidates_.empty()) throw;
      lost_ = e.what();
      asked_.reset();
    }
  }
}

Quorum LighthouseClient::quorum_once(std::int64_t step, bool fresh_group) {
  if (!asked_) ask(step, fresh_group);
  asked_.reset();
  const std::string id = std::to_string(incarnation_) + "/" + std::to_string(seq_);
  const std::string answer = "answer/" + id;
  const auto start = std::chrono::steady_clock::now();
  std::int64_t alive = -1;
  auto alive_moved_at = start;
  // Waits in slices, watching the lighthouse between them.
  const auto slice =
      std::clamp(options_.lighthouse_timeout / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(500));
  for (;;) {
    const auto left = options_.quorum_timeout -
                      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    try {
      store_.wait({answer}, std::clamp(left, std::chrono::milliseconds(1), slice));
      break;
    } catch (const TimeoutError&) {
    }
    if (left <= slice) {
      withdraw_or_wait(id);
      break;
    }
    if (abandon_) {
      throw TimeoutError("replica " + std::to_string(options_.replica_id) +
                             ": the wait for its quorum was abandoned (its owner is going away).",
                         "nothing to do");
    }
    check_lighthouse_alive(alive, alive_moved_at);
  }
  // There once waited for; the lighthouse deletes it (and its claim) when
  // this replica asks again, off the step's path.
  const auto text = dist::get_if_present(store_, answer);
  if (!text) throw InternalError("replica " + std::to_string(options_.replica_id) + ": " + answer + " vanished");
  throw_if_end_of_training(*text, step);
  return Quorum::from_text(*text);
}

void LighthouseClient::throw_if_end_of_training(const std::string& text, std::int64_t step) const {
  // Note [End of training] in src/ft/lighthouse_end.cpp: answers that are not a quorum.
  std::istringstream in(text);
  std::string word;
  std::int64_t newest = 0;
  in >> word >> newest;
  const std::string who = "replica " + std::to_string(options_.replica_id);
  if (word == "finished") {
    throw TrainingFinishedError(
        who + ": the training finished at step " + std::to_string(newest) +
            " (the other replica groups reached their last step and left) while this group, at step " +
            std::to_string(step) +
            ", waited to join; it has no peer to recover from, and its state is not the final "
            "one.",
        "nothing to do: the finished groups hold the final state (dtrain run does not restart this group)");
  }
  if (word == "lost") {
    std::string ids;
    std::getline(in >> std::ws, ids);
    throw ReplicaStateLostError(who + ": no up-to-date replica group is left: every one that held step " +
                                    std::to_string(newest) + " (replicas " + ids +
                                    ") is gone, and this group is at step " + std::to_string(step) + ".",
                                "restart the job as a whole from its newest checkpoint (dtrain run does, with "
                                "--max-restarts left)");
  }
}

void LighthouseClient::finish(std::int64_t step) {
  const std::string text = std::to_string(step) + " " + std::to_string(options_.replica_id);
  try {
    if (lost_) throw CommunicationError(*lost_, "");
    store_.set("finished", text);
  } catch (const std::exception& e) {
    if (candidates_.empty()) throw;
    reconnect(e.what());  // the next lighthouse must know it too
    lost_.reset();
    store_.set("finished", text);
  }
  DTRAIN_LOG(kInfo) << "replica " << options_.replica_id << ": finished at step " << step;
}

// Note [Members that never come]
// A quorum counts in every replica whose request was there, and one may die
// at any point of the step after asking. Two waits then lasted a fixed 10 s
// for it, holding every group (the chaos soak's --ft mode: a kill during a
// recovery, 10.2 s, 3 times in 6 with seed 5 on main's build, 2026-11-25):
// - the commit vote: a member that died after its all-reduce (or a rank of
//   its group, which takes the group's vote with it) never votes, and the
//   others waited for the decision up to commit_timeout (10 s). Seen in the
//   soak: rounds whose live members all logged an ok step, aborted 10.2 s
//   later.
// - the making of a new quorum's group: a member that asked (ahead, during
//   its optimizer step) and died before the group was made left the others
//   in the group's rendezvous for its timeout (10 s).
// Both now wait in short slices and read, between them, the heartbeat
// counters of the quorum's members (PeerWatch): one whose counter has not
// moved for the lighthouse's heartbeat timeout is dead (or stopped), and the
// step aborts now (the vote proposes abort, which is always safe: had every
// vote been in, the decision would be there; the group's making fails,
// naming it). The members ask again, and the lighthouse, by then past the
// same timeout, leaves it out.
void LighthouseClient::await_members(const Quorum& q, const std::string& prefix, std::chrono::milliseconds timeout) {
  PeerWatch watch(*this, q);
  dist::Store group = store_.with_prefix(prefix);
  const int me = q.index_of(options_.replica_id);
  group.set("here/" + std::to_string(me), "1");
  std::vector<std::string> keys;
  for (std::size_t i = 0; i < q.members.size(); ++i) keys.push_back("here/" + std::to_string(i));
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    try {
      group.wait(keys, watch.slice());
      return;
    } catch (const TimeoutError&) {
    }
    const auto now = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < q.members.size(); ++i) {
      if (group.check({keys[i]}) || !watch.silent(i, now)) continue;
      throw CommunicationError("replica " + std::to_string(options_.replica_id) + ": member replica " +
                                   std::to_string(q.members[i].replica_id) + " of " + q.describe() +
                                   " never came to make its group, and its heartbeat stopped (for the lighthouse's "
                                   "heartbeat timeout; it died or stopped after asking); the step aborts without it.",
                               "nothing to do: the next quorum leaves it out");
    }
    if (now - start >= timeout) {
      throw TimeoutError("replica " + std::to_string(options_.replica_id) + ": the members of " + q.describe() +
                             " did not all come to make its group within " + log::format_seconds(timeout) + ".",
                         "a member is alive but stuck before its step: check its log");
    }
  }
}

// Note [Collectives on a silent member]
// The gradient all-reduce waits on every member of the quorum. One whose
// link is cut (the chaos soak's --ft link_cut, two nodes in network
// namespaces) neither fails nor finishes it: Gloo's TCP pairs wait, and
// every live member stood in it for the group timeout (10 s: 10.1 s in the
// soak, 2026-11-25) although the lighthouse had dropped the silent member
// after its heartbeat timeout. A stopped process (SIGSTOP) does the same on
// shared memory. The wait now runs in slices and reads the members'
// heartbeat counters between them, as the vote does (Note [Members that
// never come]): a member silent for the heartbeat timeout fails the
// collective on the live ones, who vote to abort and ask for a fresh group;
// the next quorum leaves the silent member out. The abandoned operation may
// still run in the old group's threads until its own timeout: the caller
// keeps that group until then (destroying it would block on them).
void LighthouseClient::await_collective(const Quorum& q, const std::function<bool(std::chrono::milliseconds)>& wait_for,
                                        const std::string& what) {
  if (q.members.size() < 2) {
    while (!wait_for(std::chrono::seconds(1))) {
    }
    return;
  }
  PeerWatch watch(*this, q);
  while (!wait_for(watch.slice())) {
    const auto now = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < q.members.size(); ++i) {
      if (q.members[i].replica_id == options_.replica_id || !watch.silent(i, now)) continue;
      throw CommunicationError("replica " + std::to_string(options_.replica_id) + ": " + what + " of " + q.describe() +
                                   " waits on member replica " + std::to_string(q.members[i].replica_id) +
                                   ", whose heartbeat stopped (for the lighthouse's heartbeat timeout: it died, "
                                   "stopped, or its link is cut); the step aborts without it.",
                               "nothing to do: the next quorum leaves it out");
    }
  }
}

CommitVote commit_vote(std::int64_t sum, std::int64_t members) {
  const std::int64_t voted = sum & kVoteCountMask;
  if ((sum >> kAbortShift) > 0) return CommitVote::kAbort;
  return voted >= members ? CommitVote::kCommit : CommitVote::kWait;
}

bool LighthouseClient::agree_commit(const Quorum& q, bool ok) {
  if (candidates_.empty()) return vote(q, ok);
  if (lost_) return false;
  try {
    return vote(q, ok);
  } catch (const std::exception& e) {
    // The lighthouse was lost while the vote was in flight: this member
    // cannot read the decision and takes the step as aborted (Note
    // [Lighthouse failover]: safe, since no member applies a step whose
    // decision it did not read; one that read "commit" is ahead, and this
    // one recovers from it at the next quorum).
    const std::string why = e.what();
    DTRAIN_LOG(kWarning) << "replica " << options_.replica_id << ": the lighthouse at "
                         << candidates_[current_].to_string() << " was lost during the commit vote of " << q.describe()
                         << " (" << why.substr(0, why.find('\n')) << "); taking the step as aborted";
    lost_ = e.what();
    return false;
  }
}

bool LighthouseClient::vote(const Quorum& q, bool ok) {
  const std::string prefix = "commit/" + std::to_string(q.round) + "/";
  const std::string decision = prefix + "decision";
  const std::int64_t sum = store_.add(prefix + "votes", ok ? 1 : 1 + (std::int64_t{1} << kAbortShift));
  const auto propose = [&](const char* proposal) { return store_.compare_set(decision, "", proposal) == "commit"; };
  switch (commit_vote(sum, static_cast<std::int64_t>(q.members.size()))) {
    case CommitVote::kAbort: return propose("abort");
    case CommitVote::kCommit: return propose("commit");
    case CommitVote::kWait: break;
  }
  // Waits in slices, watching the members' heartbeats: a member that died
  // before voting never votes, and the others abort once its heartbeat
  // stopped, not at the commit timeout (Note [Members that never come]).
  PeerWatch watch(*this, q);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    try {
      store_.wait({decision}, watch.slice());
      break;
    } catch (const TimeoutError&) {
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - start >= options_.commit_timeout) {
      return propose("abort");  // a member did not vote in time; or the decision came just now
    }
    for (std::size_t i = 0; i < q.members.size(); ++i) {
      if (q.members[i].replica_id == options_.replica_id || !watch.silent(i, now)) continue;
      DTRAIN_LOG(kWarning) << "replica " << options_.replica_id << ": member replica " << q.members[i].replica_id
                           << " of " << q.describe() << " stopped heartbeating before the commit vote finished; "
                           << "aborting the step";
      return propose("abort");
    }
  }
  return dist::get_if_present(store_, decision) == "commit";
}

LighthouseClient::PeerWatch::PeerWatch(LighthouseClient& client, const Quorum& q)
    : client_(client), q_(q), beats_(q.members.size(), -1), moved_at_(q.members.size()) {
  if (client_.peer_heartbeat_timeout_.count() == 0) {
    const auto given = dist::get_if_present(client_.store_, "heartbeat_timeout_ms");
    client_.peer_heartbeat_timeout_ = std::chrono::milliseconds(given ? std::stoll(*given) : 2000);
  }
}

std::chrono::milliseconds LighthouseClient::PeerWatch::slice() const {
  return std::clamp(client_.peer_heartbeat_timeout_ / 8, std::chrono::milliseconds(5), std::chrono::milliseconds(100));
}

bool LighthouseClient::PeerWatch::silent(std::size_t i, std::chrono::steady_clock::time_point now) {
  const std::int64_t beats = client_.store_.add("hb/" + std::to_string(q_.members[i].incarnation), 0);
  if (beats != beats_[i]) {
    beats_[i] = beats;
    moved_at_[i] = now;
    return false;
  }
  return now - moved_at_[i] >= client_.peer_heartbeat_timeout_;
}

}  // namespace dtrain::ft
