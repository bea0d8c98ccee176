// The lighthouse: forms, each training step, the quorum of live replica
// groups (Note [Quorum protocol] in src/ft/lighthouse.cpp), and the client a
// replica talks to it with. Both meet in a key-value store: `dtrain run
// --ft-replicas N` hosts one (a TCPStore and this service, for the whole job),
// a test hosts it in-process with host_lighthouse() or over Store::in_memory().
//
//   auto lighthouse = ft::host_lighthouse({.port = 0});            // the job's, once
//   ft::LighthouseClient client(ft::connect_lighthouse("host", port), {.replica_id = 2});
//   ft::Quorum q = client.quorum(/*step=*/committed_steps);        // each step
//   bool commit = client.agree_commit(q, /*ok=*/all_reduce_succeeded);
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/env.h"
#include "dtrain/comm/store.h"
#include "dtrain/ft/lighthouse_address.h"
#include "dtrain/ft/quorum.h"
#include "dtrain/replica_errors.h"

namespace dtrain::ft {

struct LighthouseOptions {
  // A quorum needs at least this many replicas.
  int min_replicas = 1;
  // The first quorum waits for this many replicas (up to join_timeout), so a
  // job's replica groups start together instead of the first one to load
  // training alone and the others recovering from it (0: no such wait). A
  // standby that takes over waits so for the groups that survived node 0.
  int startup_replicas = 0;
  // A replica whose heartbeat has not moved for this long is dead: no quorum
  // waits for it (its process may still be running, stopped or cut off).
  std::chrono::milliseconds heartbeat_timeout{2000};
  // Once a replica asks for a quorum, how long to wait for live replicas that
  // have not asked yet before forming it without them.
  std::chrono::milliseconds join_timeout{10000};
  // How often the service looks at heartbeats when no request arrives; it
  // also advances its own liveness counter (ft/alive) at this pace, which
  // clients watch (LighthouseClientOptions::lighthouse_timeout).
  std::chrono::milliseconds scan_interval{50};
};

// The service over `store` (its keys under "ft/"), on a thread of its own
// until destroyed. One per job.
class Lighthouse {
 public:
  Lighthouse(dist::Store store, LighthouseOptions options);
  ~Lighthouse();
  Lighthouse(const Lighthouse&) = delete;
  Lighthouse& operator=(const Lighthouse&) = delete;
  // The quorums formed so far, in round order (the per-step membership).
  std::vector<Quorum> history() const;
  // Throws the error that stopped the service, if one did (the service also
  // writes it to ft/failed, where clients read it); ReplicaStateLostError
  // once every replica group that held the newest step is gone (the service
  // goes on answering: every request then gets that error, Note [End of
  // training]).
  void check() const;

 private:
  struct Replica;
  // A round whose commit keys stay until every member asked again.
  struct OpenRound {
    std::vector<std::int64_t> not_back_yet;  // incarnations
  };
  void serve();
  // Every replica's heartbeat and join (once per scan_interval).
  void scan(std::chrono::steady_clock::time_point now);
  void take_request(Replica& r, const std::string& join, std::chrono::steady_clock::time_point now);
  Replica* replica(std::int64_t incarnation);
  void read_registrations(std::chrono::steady_clock::time_point now);
  void add_registration(std::int64_t k, std::chrono::steady_clock::time_point now);
  // The requests the wake-ups carry.
  void read_events(std::chrono::steady_clock::time_point now);
  void member_asked_again(std::int64_t incarnation);
  // Its last answer and claim go to garbage_ (read, or never to be).
  void forget_answer(Replica& r);
  // Deletes garbage_'s keys, once the quorum (if any) is answered.
  void delete_garbage();
  void form_quorum_if_ready(std::chrono::steady_clock::time_point now);
  bool claim_answers(const std::vector<Replica*>& asking);
  // Requests no quorum can serve (every one behind the newest step): the
  // answer that ends them ("finished S", "lost S ids"), if the training
  // finished or its newest state is gone; empty while a holder may return.
  std::string end_of_training(std::chrono::steady_clock::time_point now);
  // Answers each of `asking` with `text` instead of a quorum.
  void answer_without_quorum(const std::vector<Replica*>& asking, const std::string& text);

  dist::Store store_;
  LighthouseOptions options_;
  std::vector<std::unique_ptr<Replica>> replicas_;  // by registration; the serving thread's
  std::int64_t trips_at_start_ = 0;                 // the store connection's round trips before this service
  std::int64_t registrations_seen_ = 0;
  std::int64_t inherited_registrations_ = 0;  // counted before this lighthouse started
  // Since when reg/<registrations_seen_ + 1> is missing though counted (its
  // replica died between the two): skipped after heartbeat_timeout.
  std::optional<std::chrono::steady_clock::time_point> registration_gap_since_;
  std::vector<std::int64_t> skipped_registrations_;  // re-read each scan
  std::int64_t events_seen_ = 0;
  std::int64_t events_read_ = 0;
  std::optional<std::chrono::steady_clock::time_point> event_gap_since_;
  std::chrono::steady_clock::time_point last_full_scan_{};
  std::vector<std::string> garbage_;  // keys done with, deleted off the step's path
  std::map<std::int64_t, OpenRound> open_rounds_;
  bool starting_ = false;  // no quorum formed yet on this (fresh) store
  std::chrono::steady_clock::time_point started_at_ = std::chrono::steady_clock::now();
  std::int64_t round_ = 0;         // the store's "round": the last one given out, by this lighthouse or its predecessor
  std::int64_t quorum_id_ = 0;     // the store's "quorum_id", likewise
  std::string last_members_;       // "id:incarnation ..." of the last quorum
  std::int64_t highest_step_ = 0;  // the newest step a quorum has had
  std::vector<std::int64_t> last_quorum_;  // its members' incarnations
  // The members of the last quorum at highest_step_: the holders of the
  // newest state (incarnation, replica id).
  std::vector<std::pair<std::int64_t, int>> up_to_date_;
  std::string end_;  // once decided, the answer to every request behind (end_of_training)
  bool warned_stale_ = false;
  std::atomic<bool> stop_{false};
  mutable std::mutex mutex_;  // guards history_ and error_
  std::vector<Quorum> history_;
  std::exception_ptr error_;
  std::string lost_;  // why the newest state is gone (check() throws it)
  std::thread thread_;
};

struct HostedLighthouseOptions {
  int port = 0;        // 0: a free port (see HostedLighthouse::port)
  int listen_fd = -1;  // a socket already listening on `port` to serve on
  LighthouseOptions lighthouse;
};

// A TCPStore server with the lighthouse on it.
struct HostedLighthouse {
  dist::Store store;
  std::unique_ptr<Lighthouse> lighthouse;
  int port() const { return store.port(); }
};
std::unique_ptr<HostedLighthouse> host_lighthouse(const HostedLighthouseOptions& options);

// A client's connection to the lighthouse at host:port (TimeoutError when it
// cannot be reached within `timeout`).
dist::Store connect_lighthouse(const std::string& host, int port,
                               std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Whether a lighthouse serves at `address` now: its store answers within
// `timeout` and its service has not stopped (ft/failed). Never throws.
bool lighthouse_serves(const LighthouseAddress& address, std::chrono::milliseconds timeout);
// Logs only errors from c10d in this process (Note [Timed-out waits and
// reverse DNS] in src/ft/lighthouse_failover.cpp).
void quiet_c10d_warnings();

// Where a worker of `dtrain run --ft-replicas N` finds the lighthouse, and
// which replica group it belongs to: DTRAIN_FT_LIGHTHOUSE (HOST:PORT, or an
// ordered list HOST:PORT,HOST:PORT: node 0's, then the standby's),
// DTRAIN_FT_REPLICA_ID, DTRAIN_FT_REPLICAS. ConfigError when one is missing
// or malformed.
struct LighthouseEndpoint {
  std::vector<LighthouseAddress> candidates;  // in order; at least one
  int replica_id = 0;
  int replicas = 1;
};
LighthouseEndpoint lighthouse_from_env(const dist::EnvLookup& env = dist::process_env());
// Whether `dtrain run --ft-replicas N` started this worker (DTRAIN_FT_LIGHTHOUSE
// is set): a program then trains as one replica group, e.g. with
// TrainerOptions::fault_tolerance, which reads the rest with lighthouse_from_env.
bool launched_fault_tolerant(const dist::EnvLookup& env = dist::process_env());

// The commit vote's encoding (Note [Commit vote] in
// src/ft/lighthouse_client.cpp): each member adds 1 to commit/<round>/votes,
// or 1 + 2^kAbortShift to abort; what its add returns tells it what to do.
inline constexpr int kAbortShift = 32;
inline constexpr std::int64_t kVoteCountMask = (std::int64_t{1} << kAbortShift) - 1;
enum class CommitVote {
  kAbort,   // the sum shows an abort: propose "abort"
  kCommit,  // the last of `members` votes, none an abort: propose "commit"
  kWait,    // votes are missing: wait for the decision
};
CommitVote commit_vote(std::int64_t sum, std::int64_t members);

struct LighthouseClientOptions {
  int replica_id = 0;  // this replica group's index along dp_replicate
  std::chrono::milliseconds heartbeat_interval{100};
  // How long quorum() waits for the lighthouse's answer.
  std::chrono::milliseconds quorum_timeout{std::chrono::seconds(120)};
  // How long agree_commit() waits for the other members' votes; a member
  // that has not voted by then counts as failed (one whose heartbeat
  // stopped, sooner: Note [Members that never come]).
  std::chrono::milliseconds commit_timeout{std::chrono::seconds(10)};
  // While waiting for a quorum: a lighthouse whose liveness counter has not
  // moved for this long is taken as dead (CommunicationError), as is one
  // that reports a failure (at once).
  std::chrono::milliseconds lighthouse_timeout{std::chrono::seconds(10)};
  // A client made from candidates (Note [Lighthouse failover]): how long it
  // looks for a serving one after losing its lighthouse (or at the start)
  // before a CommunicationError, and how long it gives each one per try.
  std::chrono::milliseconds failover_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds candidate_timeout{std::chrono::seconds(1)};
};

// One replica group's side. Registers (a new incarnation) and starts
// heartbeats at the first quorum(). `heartbeat_store` is a second connection
// to the same store for the heartbeat thread (may be `store` itself for an
// in-memory store), so heartbeats never queue behind a blocking wait.
// Used by one thread at a time (its calls share the connection and the
// lost-lighthouse state); abandon_waits() alone may come from another.
// FaultTolerantReplicas owns it on its asking thread while a request asked
// ahead is out, and takes it back (abandon_waits) before any other call.
class LighthouseClient {
 public:
  LighthouseClient(dist::Store store, dist::Store heartbeat_store, LighthouseClientOptions options);
  // Connects itself to the first of `candidates` that serves a lighthouse,
  // and, when that one is lost (its store fails, or its service stops),
  // to the next that serves, registering again (Note [Lighthouse failover]).
  LighthouseClient(std::vector<LighthouseAddress> candidates, LighthouseClientOptions options);
  ~LighthouseClient();
  LighthouseClient(const LighthouseClient&) = delete;
  LighthouseClient& operator=(const LighthouseClient&) = delete;

  // Asks for the next quorum, having committed `step` steps; `fresh_group`
  // asks that the quorum id change (this replica's group failed). Blocks
  // until the lighthouse answers; TimeoutError after quorum_timeout (the
  // request is then withdrawn: no later quorum counts this replica in for
  // it); CommunicationError when the lighthouse failed or stopped;
  // TrainingFinishedError when the training finished before this replica
  // (behind) could join, ReplicaStateLostError when every replica that
  // held the newest step is gone (Note [End of training]).
  Quorum quorum(std::int64_t step, bool fresh_group = false);
  // Asks now for the quorum the next quorum(step) call returns (it must pass
  // the same step, no fresh group), so the lighthouse forms it while this
  // replica finishes its step: after a committed step, when another follows.
  void ask_ahead(std::int64_t step);
  // From another thread: a quorum() waiting for its answer gives up within
  // a wait slice (TimeoutError), leaving its request to the lighthouse (its
  // peers' next step then fails at the group and aborts); a call inside a
  // withdrawal or a failover search ends at that call's own bound
  // (quorum_timeout, failover_timeout). For an owner that is going away
  // while its thread waits; clear it before asking again.
  void abandon_waits(bool abandon) { abandon_ = abandon; }
  // The commit vote of a step run in quorum `q`: true when every member
  // voted ok; every member gets the same answer (Note [Commit vote]).
  bool agree_commit(const Quorum& q, bool ok);
  std::int64_t incarnation() const { return incarnation_; }
  int replica_id() const { return options_.replica_id; }
  // The lighthouse's store, for groups made per quorum (prefixes under "pg/").
  dist::Store& store() { return store_; }
  // Which candidate this client is connected to (0 for one made from
  // stores), and how many connections it has made (a move, or a new
  // connection to the same candidate, counts); follow() makes a new
  // connection to candidate `index` unless this client already followed
  // `connections`: the other ranks of a replica group follow its rank 0, the
  // one that talks to the lighthouse, so they make the quorum's group in the
  // same store. CommunicationError when `index` does not serve.
  std::size_t connection() const { return current_; }
  std::int64_t connections() const { return connections_; }
  void follow(std::size_t index, std::int64_t connections);
  // This replica's training reached its last step, `step` (the lighthouse
  // then answers a group that asks later, behind it, with
  // TrainingFinishedError instead of leaving it waiting).
  void finish(std::int64_t step);
  // Before making the group of quorum `q` under `prefix` (in store()): marks
  // this member there and waits until every member did. A member whose
  // heartbeat has not moved for the lighthouse's heartbeat timeout (its
  // process died or stopped after it was counted into the quorum) is a
  // CommunicationError naming it, within about that timeout, not the
  // group's; TimeoutError after `timeout`. Note [Members that never come].
  void await_members(const Quorum& q, const std::string& prefix, std::chrono::milliseconds timeout);
  // Waits for a collective on quorum `q`'s group: calls `wait_for(slice)`,
  // which blocks up to `slice` and returns whether the collective is done,
  // until it returns true. A member whose heartbeat has not moved for the
  // lighthouse's heartbeat timeout (it died, stopped, or its link was cut
  // while the collective waits on it) is a CommunicationError naming it and
  // `what`, within about that timeout instead of the group's. The store is
  // read only once the first slice has passed, so a collective that ends
  // within it costs no round trip. `wait_for` must turn true at the latest
  // at the collective's own deadline (it completes with its error then).
  // Note [Collectives on a silent member].
  void await_collective(const Quorum& q, const std::function<bool(std::chrono::milliseconds)>& wait_for,
                        const std::string& what);

 private:
  void register_once();
  void beat();
  // The commit vote on the current connection (agree_commit takes a lost
  // lighthouse as abort).
  bool vote(const Quorum& q, bool ok);
  // One quorum request on the current connection (quorum() retries it on
  // the next candidate when the lighthouse is lost).
  Quorum quorum_once(std::int64_t step, bool fresh_group);
  // Connects to candidate `index`; false when it does not serve now.
  bool connect(std::size_t index);
  // The lighthouse at candidates_[current_] is lost (`why`): the heartbeat
  // stops, and the next candidate that serves within failover_timeout is
  // connected (this replica then registers again); CommunicationError naming
  // every candidate otherwise.
  void reconnect(const std::string& why);
  void stop_heartbeat();
  // Writes request seq_ + 1 (join/<k> and its wake-up).
  void ask(std::int64_t step, bool fresh_group);
  // At the quorum timeout: withdraws request `id` ("<incarnation>/<seq>"),
  // throwing TimeoutError, or returns once its answer is there (the
  // lighthouse had claimed it).
  void withdraw_or_wait(const std::string& id);
  // Throws CommunicationError when the lighthouse failed or its liveness
  // counter has not moved for lighthouse_timeout.
  // The answers that are not a quorum (Note [End of training]): throws.
  void throw_if_end_of_training(const std::string& text, std::int64_t step) const;
  void check_lighthouse_alive(std::int64_t& alive, std::chrono::steady_clock::time_point& moved_at);

  // The heartbeat counters of a quorum's members, read between the slices
  // of a wait (Note [Members that never come]).
  class PeerWatch {
   public:
    PeerWatch(LighthouseClient& client, const Quorum& q);
    std::chrono::milliseconds slice() const;
    // Reads member i's counter: whether it has not moved for the
    // lighthouse's heartbeat timeout (counted from the first reading).
    bool silent(std::size_t i, std::chrono::steady_clock::time_point now);

   private:
    LighthouseClient& client_;
    const Quorum& q_;
    std::vector<std::int64_t> beats_;
    std::vector<std::chrono::steady_clock::time_point> moved_at_;
  };

  dist::Store store_;
  dist::Store heartbeat_store_;
  LighthouseClientOptions options_;
  std::vector<LighthouseAddress> candidates_;  // empty: made from stores, no failover
  std::size_t current_ = 0;
  std::int64_t connections_ = 0;
  std::int64_t followed_ = 0;  // the rank 0's connections() this client is connected after
  // The lighthouse was lost outside quorum() (a vote, a request asked
  // ahead): the next quorum() reconnects first.
  std::optional<std::string> lost_;
  // From the last quorum answered: the floors a lighthouse that takes over
  // starts above (Note [Lighthouse failover]).
  std::int64_t last_round_ = 0;
  std::int64_t last_quorum_id_ = 0;
  std::int64_t newest_step_ = 0;
  std::int64_t incarnation_ = 0;
  std::int64_t seq_ = 0;
  std::chrono::milliseconds peer_heartbeat_timeout_{0};  // the lighthouse's (read once)
  struct Asked {
    std::int64_t step = 0;
    bool fresh_group = false;
  };
  std::optional<Asked> asked_;        // request seq_, asked ahead, not yet answered
  std::atomic<bool> stop_{false};     // the heartbeat thread's
  std::atomic<bool> abandon_{false};  // abandon_waits()
  std::thread heartbeat_;
};

}  // namespace dtrain::ft
