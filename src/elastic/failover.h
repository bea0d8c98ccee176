// Store-host failover as two small state machines (Note [Store-host failover]
// in failover.cpp): Failover finds or hosts the store that follows a lost one,
// FirstRoundGate decides whether a failover store's first round may close or
// must yield to a competing store. Every step does at most one connection or
// one seeding, and neither reads a clock, so the rendezvous drives them in
// real time and tests/unit/failover_model_test.cpp drives the same code under
// exhaustive interleavings of crashes, partitions and heals.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/elastic/rendezvous.h"

namespace dtrain::elastic::detail {

// What a node knows when its store is lost.
struct FailoverView {
  struct Member {
    std::string id;
    std::string addr;
    std::string record;  // its arrival record (JSON), re-seeded into a new store
  };
  int round = -1;                          // the newest closed round this node knows
  int restarts = 0;                        // that round's restart count
  int generation = 0;                      // of the store that was lost
  std::vector<Member> members;             // that round's, in node-rank order
  std::vector<std::string> lost_hosts;     // ids of every store host known lost (never candidates)
  std::vector<std::string> acquaintances;  // every address seen in a round or hosting a store
};

// How a failover store ranks against a competitor of the same run: the newer
// view (the round it was seeded from) wins, then the newer generation, then
// the lower host address. Read from the store's own keys, so every node that
// reads two stores ranks them alike.
struct Standing {
  int view = -1;
  int generation = 0;
  std::string host;  // the store's address (addr:port)
  bool outranks(const Standing& other) const;
};

// What a failover store says about itself; nullopt for a store that is not
// (yet) a seeded failover store.
struct StoreFacts {
  Standing standing;
  std::string addr;  // the host's address, without the port
  std::string host_id;
  int first_round = 0;
  // Its first round's fate, decided once (create-if-absent): "closed", or
  // "moved <addr>" when it yielded to the store at addr.
  std::optional<std::string> settled;
};
std::optional<StoreFacts> read_facts(RendezvousStore& store);

// How a node reaches other nodes' stores. Both return nullptr for "not now"
// (nothing answers, the port is still taken) rather than throwing.
struct FailoverNet {
  std::function<std::shared_ptr<RendezvousStore>(const std::string& addr)> connect;
  std::function<std::shared_ptr<RendezvousStore>()> host;  // at this node's own address
};

struct FailoverOptions {
  std::string node_id;
  std::string addr;         // this node's (the address part of its store's addr:port)
  std::string port_suffix;  // ":<port>", appended to addresses to name stores
  std::string run_id;
  int min_nodes = 1;
  int max_nodes = 1;
  bool quorum_min = false;  // --rdzv-conf failover_quorum=min
  // Steps spent on a candidate before moving on (0: until give_up_on_candidate()).
  int tries_per_candidate = 0;
  int max_passes = 0;  // walks over all candidates before giving up (0: never)
};

// Finds the store that follows the lost one: walks the view's members in
// node-rank order, skipping lost hosts; hosts a new store when the candidate
// is this node, joins a candidate's store when it is seeded and not outranked
// by this node's own view (or its first round has closed already), and
// follows "moved" records. Contract: step() until it returns other than
// kSeeking; then store() and the accessors describe the result.
class Failover {
 public:
  enum class Status { kSeeking, kHosting, kJoined, kGaveUp };
  Failover(FailoverView view, FailoverOptions options, FailoverNet net);
  // Seeks the store at `addr` first (a store that yielded pointed there).
  void follow(const std::string& addr);
  Status step();
  // The current candidate (or followed store) has had its time: the next step
  // tries the next one. The rendezvous calls this after a real-time patience.
  void give_up_on_candidate();

  const std::shared_ptr<RendezvousStore>& store() const { return store_; }
  const StoreFacts& facts() const { return facts_; }
  const std::string& where() const { return facts_.standing.host; }
  const FailoverView& view() const { return view_; }
  std::string last_problem() const { return problem_; }
  // What is being tried now (a candidate, or a store being followed), to time its patience.
  std::string target() const;

 private:
  bool accept(const std::shared_ptr<RendezvousStore>& candidate, bool followed);
  void seed(RendezvousStore& next);
  void next_candidate();
  bool tried_enough();  // counts a try; true when the candidate has had its tries

  FailoverView view_;
  FailoverOptions opt_;
  FailoverNet net_;
  std::size_t candidate_ = 0;
  int tries_ = 0;
  int passes_ = 0;
  std::optional<std::string> following_;
  int follows_ = 0;
  std::shared_ptr<RendezvousStore> store_;
  StoreFacts facts_;
  std::string problem_;
};

// Whether the first round of a failover store may close, or the store yields.
// A sweep probes every acquaintance's address for a competing failover store;
// one that outranks this one (or whose first round closed) wins and this
// store settles "moved"; a competitor this store outranks is told to move
// here. Contract: start a sweep with begin(); step() probes one address per
// call until it returns kClear (no store outranks this one: settle() may close
// it) or kYield (moved_to() names the winner).
class FirstRoundGate {
 public:
  enum class Status { kProbing, kClear, kYield };
  FirstRoundGate(std::shared_ptr<RendezvousStore> own, std::vector<std::string> acquaintances, FailoverNet net,
                 std::string own_addr);
  void begin();
  Status step();
  // After kClear: decides the store's fate (create-if-absent). True: "closed"
  // is this store's fate, and the first round may close; false: it moved
  // (moved_to() says where).
  bool settle();
  // Whether the store has settled "moved" (a competitor told it so).
  bool moved();
  const std::string& moved_to() const { return moved_to_; }

 private:
  bool yield_to(const std::string& where);
  std::shared_ptr<RendezvousStore> own_;
  std::vector<std::string> addresses_;
  FailoverNet net_;
  std::string own_addr_;
  std::size_t next_ = 0;
  std::string moved_to_;
};

// Nodes a round needs besides MIN to close: a strict majority of `members`
// for the first round after a failover (0 with failover_quorum=min).
int failover_quorum(std::size_t members, bool quorum_min);

}  // namespace dtrain::elastic::detail
