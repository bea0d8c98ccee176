// The lighthouse service (include/dtrain/ft/lighthouse.h).
//
// Note [Quorum protocol]
// Replica groups meet the lighthouse in a key-value store, under "ft/":
//   nreg, reg/<k>        a registration: `add(nreg, 1)` gives the incarnation k,
//                        reg/<k> holds the replica id. A restarted replica
//                        registers again under a new k; the older one is gone.
//   hb/<k>               the heartbeat: a counter the replica's heartbeat
//                        thread adds to every interval. The lighthouse keeps,
//                        on its own clock, when each counter last moved (no
//                        clocks are compared across machines).
//   join/<k>             "seq step fresh": the replica's seq-th request for a
//                        quorum, with the steps it has committed, and whether
//                        its group failed (it asks for a fresh one).
//   nev, ev/<m>          wake-ups: a client that writes a join also sets the
//                        next ev/<m> to "<k> <its join>", on which the
//                        lighthouse blocks; it takes the request from there
//                        (one read per request, not one per replica), and
//                        reads every join/<k> and hb/<k> once per
//                        scan_interval regardless, so a wake-up lost to a
//                        client that died half-way costs latency, not
//                        progress. It deletes each ev/<m> once read (waiting
//                        up to heartbeat_timeout for one counted, not yet set).
//                        reg/, hb/ and join/ of an incarnation go when a
//                        newer one of its replica id registers.
//   claim/<k>/<seq>      who owns that request: the lighthouse claims it
//                        ("lighthouse", compare_set) before answering; a
//                        client that gives up withdraws it ("withdrawn") the
//                        same way. Exactly one wins, so a withdrawn request
//                        is never answered with the replica as a member
//                        (the others would wait for it in their step), and a
//                        claimed one is always answered.
//   answer/<k>/<seq>     the quorum given to that request. The lighthouse
//                        deletes it and its claim once the replica asks again
//                        (so it has read it), after the quorum of that next
//                        request is answered: off the step's path.
//   commit/<round>/...   the commit vote (Note [Commit vote]): two keys, votes
//                        and decision, deleted once every member of the round
//                        asked for a later quorum (so it finished voting).
//                        Rounds of a member that died keep theirs: the store
//                        grows by a few keys per failure, not per step.
//   alive                the lighthouse's liveness counter (every
//                        scan_interval); failed: the error that stopped it.
//                        Clients waiting for a quorum watch both.
//   round, quorum_id     the last round and quorum id given out, so a
//                        lighthouse restarted on the same store goes on from
//                        them: its groups (pg/<quorum id>/...) and votes
//                        (commit/<round>/...) never meet its predecessor's
//                        leftover keys.
// A lighthouse restarted on the same store finds the registrations (and the
// last requests) of replicas that may have died meanwhile: such a replica
// counts as live only once its heartbeat moves under the new lighthouse's
// eyes. It does not know the newest step its predecessor saw (see Note
// [Ranks at different steps] in replicas.cpp for what a replica group
// checks on its own), nor which requests its predecessor answered: one may
// be answered again, and a quorum that counts in a replica not waiting for
// it fails to make its group, so its members abort that step and ask for a
// fresh one. `dtrain run` hosts the store and the lighthouse together: a
// restart on the same store is for a lighthouse hosted on its own.
// A registration counted in nreg whose reg/<k> never comes (the replica died
// in between) is skipped after heartbeat_timeout, so later ones are seen.
// A quorum is formed when at least min_replicas live replicas have asked and
// either every live replica has asked or join_timeout has passed since the
// first of them did. Live: its heartbeat moved within heartbeat_timeout, so a
// SIGKILLed replica stops being waited for a heartbeat timeout after it died
// (heartbeats are read every scan_interval: up to that much later).
// Members are sorted by replica id; their index is their rank in the
// quorum's group. The quorum id changes when the members (ids or
// incarnations) differ from the last quorum's or a member asks for a fresh
// group: members agreeing on a quorum id may reuse the group they made for it.
// A quorum also needs a member at the newest step any quorum has seen, so
// replicas that all lost that state (every up-to-date one died) wait instead
// of training on from an old step, and a member of the last quorum, so
// quorums form a chain: no two disjoint ones ever run the same step (a
// replica dropped while its request was pending is not answered alone
// while the others step on). What ends requests that can never be served
// is Note [End of training] (src/ft/lighthouse_end.cpp). The lighthouse
// decides membership only; who is
// behind and who recovers from whom each member computes alike from the
// quorum (quorum.h).
//
// Note [Lighthouse round trips]
// Every store call is a round trip to the store's server, and the service
// makes them one after another, while the replicas wait for its answer: the
// step's cost grows with them (docs/fault_tolerance.md, "Store round trips
// per step"). Per step it makes, for G replicas: on each wake-up the wait and
// the read of nev, one read per request (its ev/<m>); to answer, G claims,
// the round's add and one multi-set of the G answers; then, off the step's
// path, the deletes (G wake-ups, the previous answers and claims, two vote
// keys). Heartbeats, joins and registrations are read once per
// scan_interval (and registrations when a request names an unknown
// incarnation), not on every wake-up.
#include <algorithm>
#include <sstream>
#include <string>

#include "dtrain/comm/store_keys.h"
#include "dtrain/error.h"
#include "dtrain/ft/lighthouse.h"
#include "dtrain/log.h"
#include "lighthouse_replica.h"

namespace dtrain::ft {

using Clock = std::chrono::steady_clock;

Lighthouse::Lighthouse(dist::Store store, LighthouseOptions options)
    : store_(store.with_prefix("ft")), options_(options) {
  DTRAIN_CHECK(options_.min_replicas >= 1, ConfigError,
               "lighthouse: min_replicas " << options_.min_replicas << " is below 1.", "pass 1 or more");
  // A predecessor's, when restarted on the same store (Note [Quorum protocol]).
  trips_at_start_ = dist::round_trips(store_);
  inherited_registrations_ = store_.add("nreg", 0);
  // Its wake-ups, read or not, are behind us: their requests are in join/<k>
  // (read by the first full scan), and the next wake-up is the one to wait for.
  events_seen_ = events_read_ = store_.add("nev", 0);
  round_ = store_.add("round", 0);
  quorum_id_ = store_.add("quorum_id", 0);
  // A fresh store (not a restart on its predecessor's): the first quorum
  // waits for startup_replicas, also when the requests' floors (Note
  // [Lighthouse failover]) raise the ids before it forms.
  starting_ = round_ == 0;
  // Clients judge a peer that never comes to a group by the same timeout
  // (Note [Members that never come] in lighthouse_client.cpp).
  store_.set("heartbeat_timeout_ms", std::to_string(options_.heartbeat_timeout.count()));
  thread_ = std::thread([this] {
    try {
      serve();
    } catch (const std::exception& e) {
      DTRAIN_LOG(kError) << "lighthouse: stopped serving: " << e.what();
      {
        std::lock_guard lock(mutex_);
        error_ = std::current_exception();
      }
      try {
        store_.set("failed", e.what());  // replicas waiting for a quorum read it
      } catch (const std::exception&) {
        // the store itself is gone: the replicas' calls fail on their own
      }
    }
  });
}

Lighthouse::~Lighthouse() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  // Its cost, for docs/fault_tolerance.md's "Store round trips per step".
  const std::int64_t trips = dist::round_trips(store_) - trips_at_start_;
  DTRAIN_LOG(kInfo) << "lighthouse: " << history_.size() << " rounds, " << trips << " store round trips"
                    << (history_.empty() ? std::string()
                                         : " (" + std::to_string(trips / static_cast<std::int64_t>(history_.size())) +
                                               " per round)");
}

std::vector<Quorum> Lighthouse::history() const {
  std::lock_guard lock(mutex_);
  return history_;
}

void Lighthouse::check() const {
  std::lock_guard lock(mutex_);
  if (error_) std::rethrow_exception(error_);
  if (!lost_.empty()) {
    throw ReplicaStateLostError("lighthouse: " + lost_,
                                "restart the job as a whole: every group resumes from the newest checkpoint");
  }
}

void Lighthouse::serve() {
  while (!stop_) {
    try {
      // The first wake-up not read yet: one counted but not yet set (its
      // client is between add(nev) and set) wakes us as soon as it is.
      store_.wait({"ev/" + std::to_string(events_read_ + 1)}, options_.scan_interval);
      events_seen_ = store_.add("nev", 0);
    } catch (const TimeoutError&) {
      // a scan on the clock: heartbeats age, join timeouts pass
    }
    const auto now = Clock::now();
    read_events(now);
    // Heartbeats, joins and registrations once per scan_interval, not on
    // every wake-up (Note [Lighthouse round trips]).
    const bool full_scan = now - last_full_scan_ >= options_.scan_interval;
    if (full_scan) {
      scan(now);
      last_full_scan_ = now;
    }
    form_quorum_if_ready(now);
    // What is left is off the step's path: the replicas have their answers.
    if (full_scan) store_.add("alive", 1);
    delete_garbage();
  }
}

void Lighthouse::read_events(Clock::time_point now) {
  // Wake-ups counted, in order: each carries its request. One counted but
  // not yet set (its client is between add(nev) and set) is waited for, up
  // to the heartbeat timeout (its client died in between); its request, if
  // its client lives, is read from join/<k> by the next full scan.
  while (events_read_ < events_seen_) {
    const std::string key = "ev/" + std::to_string(events_read_ + 1);
    const auto text = dist::get_if_present(store_, key);
    if (!text) {
      if (!event_gap_since_) event_gap_since_ = now;
      if (now - *event_gap_since_ < options_.heartbeat_timeout) return;
      // Skipped: its client may still set it; the key is then left behind.
    } else {
      std::istringstream event(*text);
      std::int64_t k = 0;
      event >> k;
      std::string join;
      std::getline(event >> std::ws, join);
      Replica* r = replica(k);
      if (r == nullptr && k > registrations_seen_) {
        read_registrations(now);  // a replica registered since the last full scan
        r = replica(k);
      }
      if (r != nullptr) take_request(*r, join, now);  // none: superseded, or its registration not read yet
      garbage_.push_back(key);
    }
    event_gap_since_.reset();
    ++events_read_;
  }
}

Lighthouse::Replica* Lighthouse::replica(std::int64_t incarnation) {
  for (auto& r : replicas_) {
    if (r->incarnation == incarnation) return r.get();
  }
  return nullptr;
}

void Lighthouse::delete_garbage() {
  for (const auto& key : garbage_) dist::delete_key(store_, key);
  garbage_.clear();
}

void Lighthouse::read_registrations(Clock::time_point now) {
  // Registrations skipped as half-written that were completed after all (a
  // replica slower than the heartbeat timeout between its two writes).
  std::erase_if(skipped_registrations_, [&](std::int64_t k) {
    if (!store_.check({"reg/" + std::to_string(k)})) return false;
    add_registration(k, now);
    return true;
  });
  const std::int64_t registered = store_.add("nreg", 0);
  while (registrations_seen_ < registered) {
    const std::int64_t k = registrations_seen_ + 1;
    if (!store_.check({"reg/" + std::to_string(k)})) {
      // Counted, not yet written: its replica is writing it, or died in between.
      if (!registration_gap_since_) registration_gap_since_ = now;
      if (now - *registration_gap_since_ < options_.heartbeat_timeout) break;
      DTRAIN_LOG(kWarning) << "lighthouse: registration " << k << " was not completed within the heartbeat timeout "
                           << "(its replica died while registering?); going on without it";
      skipped_registrations_.push_back(k);
      registration_gap_since_.reset();
      ++registrations_seen_;
      continue;
    }
    registration_gap_since_.reset();
    ++registrations_seen_;
    add_registration(k, now);
  }
}

void Lighthouse::add_registration(std::int64_t k, Clock::time_point now) {
  const std::string key = "reg/" + std::to_string(k);
  const std::string text = store_.get(key);
  int id = -1;
  try {
    id = std::stoi(text);
  } catch (const std::exception&) {
  }
  if (id < 0) throw InternalError("lighthouse: registration " + key + " holds '" + text + "', not a replica id");
  for (const auto& r : replicas_) {
    if (r->id != id) continue;
    if (r->incarnation > k) return;  // a late, half-written one: a newer process already registered
    // Superseded: its keys go (a process still running under it is gone for the quorum).
    const std::string old = std::to_string(r->incarnation);
    for (const char* prefix : {"reg/", "hb/", "join/"}) dist::delete_key(store_, prefix + old);
    forget_answer(*r);
  }
  std::erase_if(replicas_, [id](const auto& r) { return r->id == id; });
  auto r = std::make_unique<Replica>();
  r->id = id;
  r->incarnation = k;
  r->inherited = k <= inherited_registrations_;
  r->last_beat = r->inherited ? now - options_.heartbeat_timeout : now;
  DTRAIN_LOG(kInfo) << "lighthouse: replica " << id << " registered (incarnation " << r->incarnation << ")";
  replicas_.push_back(std::move(r));
}

void Lighthouse::member_asked_again(std::int64_t incarnation) {
  for (auto it = open_rounds_.begin(); it != open_rounds_.end();) {
    std::erase(it->second.not_back_yet, incarnation);
    if (!it->second.not_back_yet.empty()) {
      ++it;
      continue;
    }
    const std::string prefix = "commit/" + std::to_string(it->first) + "/";
    garbage_.push_back(prefix + "votes");
    garbage_.push_back(prefix + "decision");
    it = open_rounds_.erase(it);
  }
}

void Lighthouse::scan(Clock::time_point now) {
  read_registrations(now);
  for (auto& r : replicas_) {
    const std::string k = std::to_string(r->incarnation);
    const std::int64_t beats = store_.add("hb/" + k, 0);
    if (beats != r->beats) {
      if (r->beats >= 0 || !r->inherited) r->last_beat = now;
      r->beats = beats;
    }
    if (const auto join = dist::get_if_present(store_, "join/" + k)) take_request(*r, *join, now);
  }
}

void Lighthouse::take_request(Replica& r, const std::string& text, Clock::time_point now) {
  std::istringstream join(text);
  std::int64_t seq = 0, step = 0;
  int fresh = 0;
  join >> seq >> step >> fresh;
  // The floors (Note [Lighthouse failover] in lighthouse_failover.cpp): the
  // ids and newest step of the replica's last quorum, perhaps another
  // lighthouse's; absent (0) from a client that never had one.
  std::int64_t quorum_id_floor = 0, round_floor = 0, newest_floor = 0;
  join >> quorum_id_floor >> round_floor >> newest_floor;
  if (quorum_id_ < quorum_id_floor) quorum_id_ = store_.add("quorum_id", quorum_id_floor - quorum_id_);
  if (round_ < round_floor) round_ = store_.add("round", round_floor - round_);
  highest_step_ = std::max(highest_step_, newest_floor);
  // A newer request replaces a pending one (its client withdrew the old).
  if (seq <= r.answered_seq || (r.pending && seq <= r.seq)) return;
  if (r.pending) {
    // withdrawn, never to be claimed now
    dist::delete_key(store_, "claim/" + std::to_string(r.incarnation) + "/" + std::to_string(r.seq));
  } else {
    member_asked_again(r.incarnation);
    forget_answer(r);  // read: the replica asks again
  }
  r.pending = true;
  r.seq = seq;
  r.step = step;
  r.fresh = fresh != 0;
  r.asked_at = now;
}

void Lighthouse::forget_answer(Replica& r) {
  if (r.answer_kept == 0) return;
  const std::string id = std::to_string(r.incarnation) + "/" + std::to_string(r.answer_kept);
  garbage_.push_back("answer/" + id);
  garbage_.push_back("claim/" + id);
  r.answer_kept = 0;
}

bool Lighthouse::claim_answers(const std::vector<Replica*>& asking) {
  bool all = true;
  std::vector<std::string> claimed;
  for (Replica* r : asking) {
    const std::string key = "claim/" + std::to_string(r->incarnation) + "/" + std::to_string(r->seq);
    if (store_.compare_set(key, "", "lighthouse") == "lighthouse") {
      claimed.push_back(key);
      continue;
    }
    // Withdrawn: the client gave up on this request.
    dist::delete_key(store_, key);
    r->answered_seq = r->seq;
    r->pending = false;
    all = false;
  }
  // No quorum now: the claims just taken are released, so their clients may
  // still withdraw (a claim promises an answer; this scan gives none). Their
  // requests stay pending and are claimed again when a quorum forms.
  if (!all) {
    for (const auto& key : claimed) dist::delete_key(store_, key);
  }
  return all;
}

void Lighthouse::form_quorum_if_ready(Clock::time_point now) {
  std::vector<Replica*> asking;
  bool all_live_asked = true;
  Clock::time_point first_ask = now;
  for (auto& r : replicas_) {
    const bool live = now - r->last_beat < options_.heartbeat_timeout;
    if (!live) continue;
    if (!r->pending) {
      all_live_asked = false;
      continue;
    }
    asking.push_back(r.get());
    first_ask = std::min(first_ask, r->asked_at);
  }
  if (static_cast<int>(asking.size()) < options_.min_replicas) return;
  if (!all_live_asked && now - first_ask < options_.join_timeout) return;
  if (starting_ && static_cast<int>(asking.size()) < options_.startup_replicas &&
      now - first_ask < options_.join_timeout) {
    return;
  }
  // Someone must hold the newest state: replicas that are all behind it (the
  // up-to-date ones died) would otherwise train on from an old step.
  std::int64_t newest = 0;
  for (const Replica* r : asking) newest = std::max(newest, r->step);
  if (newest < highest_step_) {
    if (const std::string end = end_of_training(now); !end.empty()) {
      answer_without_quorum(asking, end);
      return;
    }
    if (!warned_stale_) {
      DTRAIN_LOG(kWarning) << "lighthouse: no replica asking for a quorum has step " << highest_step_
                           << " (the newest reported); waiting for one that has";
    }
    warned_stale_ = true;
    return;
  }
  // And it must share a member with the last quorum: two quorums that share
  // none could commit the same step twice, differently (a replica cut off
  // and back, its old request answered alone while the others step on).
  if (!last_quorum_.empty() && std::none_of(asking.begin(), asking.end(), [this](const Replica* r) {
        return std::find(last_quorum_.begin(), last_quorum_.end(), r->incarnation) != last_quorum_.end();
      })) {
    return;
  }
  // Every member must still be waiting (a request withdrawn after a timeout
  // is not answered); otherwise look again at the next scan.
  if (!claim_answers(asking)) return;
  starting_ = false;
  highest_step_ = newest;
  warned_stale_ = false;
  last_quorum_.clear();
  up_to_date_.clear();
  for (const Replica* r : asking) {
    last_quorum_.push_back(r->incarnation);
    if (r->step == newest) up_to_date_.emplace_back(r->incarnation, r->id);
  }
  std::sort(asking.begin(), asking.end(), [](const Replica* a, const Replica* b) { return a->id < b->id; });
  Quorum q;
  std::string members;
  bool fresh = false;
  for (const Replica* r : asking) {
    q.members.push_back({.replica_id = r->id, .incarnation = r->incarnation, .step = r->step});
    members += std::to_string(r->id) + ":" + std::to_string(r->incarnation) + " ";
    fresh = fresh || r->fresh;
  }
  if (members != last_members_ || fresh) quorum_id_ = store_.add("quorum_id", 1);
  last_members_ = members;
  round_ = store_.add("round", 1);
  q.round = round_;
  q.quorum_id = quorum_id_;
  const std::string text = q.to_text();
  if (quorum_id_ != (history_.empty() ? 0 : history_.back().quorum_id)) {
    DTRAIN_LOG(kInfo) << "lighthouse: " << q.describe();
  }
  {
    // Recorded before anyone is answered: a member that reads history()
    // after its answer finds its quorum there.
    std::lock_guard lock(mutex_);
    history_.push_back(q);
  }
  OpenRound& open = open_rounds_[q.round];
  std::vector<std::string> keys;
  for (Replica* r : asking) {
    open.not_back_yet.push_back(r->incarnation);
    keys.push_back("answer/" + std::to_string(r->incarnation) + "/" + std::to_string(r->seq));
    r->answered_seq = r->seq;
    r->answer_kept = r->seq;
    r->pending = false;
  }
  dist::multi_set(store_, keys, std::vector<std::string>(keys.size(), text));
}

std::unique_ptr<HostedLighthouse> host_lighthouse(const HostedLighthouseOptions& options) {
  auto hosted = std::make_unique<HostedLighthouse>(
      HostedLighthouse{.store = dist::Store::tcp({.host = "127.0.0.1",
                                                  .port = options.port,
                                                  .is_server = true,
                                                  .timeout = std::chrono::seconds(60),
                                                  .listen_fd = options.listen_fd}),
                       .lighthouse = nullptr});
  hosted->lighthouse = std::make_unique<Lighthouse>(hosted->store, options.lighthouse);
  return hosted;
}

dist::Store connect_lighthouse(const std::string& host, int port, std::chrono::milliseconds timeout) {
  return dist::Store::tcp({.host = host, .port = port, .is_server = false, .timeout = timeout});
}

}  // namespace dtrain::ft
