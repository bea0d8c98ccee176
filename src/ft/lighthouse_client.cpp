// A replica group's side of the lighthouse (include/dtrain/ft/lighthouse.h;
// the keys are in Note [Quorum protocol], src/ft/lighthouse.cpp).
//
// Note [Commit vote]
// A step commits only if every member of its quorum finished its gradient
// all-reduce: a member that failed (or died) mid-step must not leave the
// others with an update it never applied, nor apply half of one itself.
// Each member sets commit/<round>/vote/<id> to 1 or 0, then proposes a
// decision through compare_set on commit/<round>/decision, which keeps the
// first proposal: "commit" when it read a 1 from every member, "abort" when
// it voted 0, read a 0, or a member's vote did not come within
// commit_timeout (a dead member never votes). Every member then acts on the
// stored decision, so all commit or none do, even when one member timed out
// on a vote that another saw arrive. A member that dies after voting is
// simply behind at the next quorum and recovers from a peer.
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
  const std::string address = get("DTRAIN_FT_LIGHTHOUSE");
  const auto colon = address.rfind(':');
  DTRAIN_CHECK(colon != std::string::npos && colon > 0, ConfigError,
               "DTRAIN_FT_LIGHTHOUSE=" << address << " is not HOST:PORT.", "e.g. 127.0.0.1:29600");
  e.host = address.substr(0, colon);
  e.port = dist::detail::parse_int("DTRAIN_FT_LIGHTHOUSE port", address.substr(colon + 1), 1, 65535);
  e.replicas = dist::detail::parse_int("DTRAIN_FT_REPLICAS", get("DTRAIN_FT_REPLICAS"), 1, 1 << 16);
  e.replica_id = dist::detail::parse_int("DTRAIN_FT_REPLICA_ID", get("DTRAIN_FT_REPLICA_ID"), 0, e.replicas - 1);
  return e;
}

LighthouseClient::LighthouseClient(dist::Store store, dist::Store heartbeat_store, LighthouseClientOptions options)
    : store_(store.with_prefix("ft")), heartbeat_store_(heartbeat_store.with_prefix("ft")), options_(options) {
  DTRAIN_CHECK(options_.replica_id >= 0, ConfigError, "replica id " << options_.replica_id << " is negative.",
               "number replica groups 0, 1, ...");
}

LighthouseClient::~LighthouseClient() {
  stop_ = true;
  if (heartbeat_.joinable()) heartbeat_.join();
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

Quorum LighthouseClient::quorum(std::int64_t step, bool fresh_group) {
  register_once();
  const std::string k = std::to_string(incarnation_);
  const std::int64_t seq = ++seq_;
  const std::string id = k + "/" + std::to_string(seq);
  store_.set("join/" + k, std::to_string(seq) + " " + std::to_string(step) + " " + (fresh_group ? "1" : "0"));
  store_.set("ev/" + std::to_string(store_.add("nev", 1)), "");
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
    check_lighthouse_alive(alive, alive_moved_at);
  }
  const std::string text = store_.get(answer);
  dist::delete_key(store_, answer);
  dist::delete_key(store_, "claim/" + id);
  return Quorum::from_text(text);
}

bool LighthouseClient::agree_commit(const Quorum& q, bool ok) {
  const std::string prefix = "commit/" + std::to_string(q.round) + "/";
  store_.set(prefix + "vote/" + std::to_string(options_.replica_id), ok ? "1" : "0");
  std::string proposal = "abort";
  if (ok) {
    std::vector<std::string> votes;
    for (const auto& m : q.members) votes.push_back(prefix + "vote/" + std::to_string(m.replica_id));
    const auto deadline = std::chrono::steady_clock::now() + options_.commit_timeout;
    for (;;) {
      try {
        // Short waits, so a decision already taken (an abort) is seen early.
        store_.wait(votes, std::chrono::milliseconds(20));
        proposal = "commit";
        for (const auto& v : votes) {
          if (store_.get(v) != "1") proposal = "abort";
        }
        break;
      } catch (const TimeoutError&) {
        if (store_.check({prefix + "decision"}) || std::chrono::steady_clock::now() >= deadline) break;
      }
    }
  }
  return store_.compare_set(prefix + "decision", "", proposal) == "commit";
}

}  // namespace dtrain::ft
