// Note [Store-host failover] checked beyond examples: nodes are state
// machines that drive the real Failover and FirstRoundGate code over
// in-memory stores, and a scheduler interleaves their steps with crashes,
// partitions and heals injected at every point. Each node step does one
// thing: one store operation, one failover step or one probe of a sweep.
// Invariants checked after every step and at the end of each schedule:
//   - one group: at no time do two closed first rounds each have all their
//     members alive and training in them (no split brain);
//   - without partitions, at most one live store per generation has closed
//     its first round (one host per generation reaches quorum; a dead one's
//     successors may be numbered alike by nodes that never joined it);
//   - liveness: once faults stop and links heal, one store whose first round
//     closed holds a majority of the live nodes (training in it, or waiting
//     for its next round), whenever the live nodes are a majority of the job's.
// Schedules: every interleaving of the issue-30 history (the partitioned
// node, excluded from the newest round, then the store host killed), and
// seeded random ones; DTRAIN_FAILOVER_SCHEDULES raises their number (bench).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "../../src/elastic/failover.h"
#include "../../src/elastic/rendezvous_keys.h"
#include "dtrain/elastic/rendezvous.h"
#include "dtrain/error.h"

namespace {

using namespace dtrain::elastic;
using namespace dtrain::elastic::detail;

constexpr int kNoNode = -1;

struct World;

// One node's connection to the store hosted by `host`: fails like a TCP
// client when the host crashed, the store was replaced, or the link is cut.
class Link : public RendezvousStore {
 public:
  Link(World& w, int from, int host, int incarnation, std::shared_ptr<RendezvousStore> s)
      : w_(w), from_(from), host_(host), incarnation_(incarnation), s_(std::move(s)) {}
  void set(const std::string& k, const std::string& v) override {
    check();
    s_->set(k, v);
  }
  std::optional<std::string> try_get(const std::string& k) override {
    check();
    return s_->try_get(k);
  }
  std::int64_t add(const std::string& k, std::int64_t d) override {
    check();
    return s_->add(k, d);
  }
  std::string create_if_absent(const std::string& k, const std::string& v) override {
    check();
    return s_->create_if_absent(k, v);
  }
  bool hosts_store() const override { return from_ == host_; }
  int host() const { return host_; }
  int incarnation() const { return incarnation_; }

 private:
  void check() const;
  World& w_;
  int from_, host_, incarnation_;
  std::shared_ptr<RendezvousStore> s_;
};

// The store itself: a map, as the in-memory store keeps it, without locks
// (one thread) so that thousands of schedules run in seconds.
class MapStore : public RendezvousStore {
 public:
  void set(const std::string& k, const std::string& v) override { m_[k] = v; }
  std::optional<std::string> try_get(const std::string& k) override {
    const auto it = m_.find(k);
    return it == m_.end() ? std::nullopt : std::optional<std::string>(it->second);
  }
  std::int64_t add(const std::string& k, std::int64_t d) override {
    const std::int64_t v = std::stoll(try_get(k).value_or("0")) + d;
    m_[k] = std::to_string(v);
    return v;
  }
  std::string create_if_absent(const std::string& k, const std::string& v) override {
    return m_.emplace(k, v).first->second;
  }
  bool hosts_store() const override { return true; }

 private:
  std::map<std::string, std::string> m_;
};

struct Hosted {
  std::shared_ptr<RendezvousStore> store;
  int incarnation = 0;
};

struct World {
  int n = 3;
  std::vector<bool> alive;
  std::vector<std::vector<bool>> cut;
  std::vector<std::optional<Hosted>> hosted;  // by node
  int incarnations = 0;
  bool partitioned_ever = false;
  // generation -> stores (host, incarnation) whose first round closed
  std::map<int, std::set<std::pair<int, int>>> closed_by_generation;
  bool up(const std::pair<int, int>& store) const {
    return alive[store.first] && hosted[store.first] && hosted[store.first]->incarnation == store.second;
  }

  static std::string addr(int i) { return "10.0.0." + std::to_string(i + 1); }
  bool reachable(int a, int b) const { return a == b || !cut[a][b]; }
  int node_at(const std::string& a) const {
    for (int i = 0; i < n; ++i) {
      if (addr(i) == a) return i;
    }
    return kNoNode;
  }
  std::shared_ptr<Link> link(int from, int host) {
    if (!alive[host] || !hosted[host] || !reachable(from, host)) return nullptr;
    return std::make_shared<Link>(*this, from, host, hosted[host]->incarnation, hosted[host]->store);
  }
};

void Link::check() const {
  const bool ok = w_.alive[from_] && w_.alive[host_] && w_.hosted[host_] &&
                  w_.hosted[host_]->incarnation == incarnation_ && w_.reachable(from_, host_);
  if (!ok) throw dtrain::CommunicationError("model: store of node " + std::to_string(host_) + " unreachable", "");
}

std::string record(int i) {
  return nlohmann::json{{"id", "n" + std::to_string(i)}, {"addr", World::addr(i)}}.dump();
}

// A node of the model: the rendezvous's failover path, one action per step.
class Node {
 public:
  enum class Phase { kRunning, kSeeking, kForming, kClosing, kTraining, kWaiting, kStopped };
  Node(World& w, int i) : w_(w), i_(i) {}

  // Starts as a member of `round` (with `members`) on the store hosted by `host`.
  void start(int round, const std::vector<int>& members, int host) {
    view_.round = round;
    view_.generation = 0;
    for (int m : members) view_.members.push_back({.id = id(m), .addr = World::addr(m), .record = record(m)});
    for (int m = 0; m < w_.n; ++m) view_.acquaintances.push_back(World::addr(m));
    host_id_ = id(host);
    store_ = w_.link(i_, host);
    phase_ = store_ ? Phase::kRunning : Phase::kSeeking;
    if (!store_) begin_failover(std::nullopt);
  }

  void step() {
    if (!w_.alive[i_] || phase_ == Phase::kStopped) return;
    try {
      act();
    } catch (const dtrain::CommunicationError&) {
      begin_failover(std::nullopt);
    }
  }

  Phase phase() const { return phase_; }
  // The store this node is in (host node, incarnation); kNoNode when none.
  std::pair<int, int> where() const {
    if (!store_ || phase_ == Phase::kSeeking || phase_ == Phase::kStopped) return {kNoNode, 0};
    return {store_->host(), store_->incarnation()};
  }
  int first_round() const { return facts_.first_round; }
  const std::vector<int>& group() const { return group_; }
  std::string describe() const {
    static const char* names[] = {"running", "seeking", "forming", "closing", "training", "waiting", "stopped"};
    std::ostringstream o;
    o << "n" << i_ << ":" << names[static_cast<int>(phase_)] << "@" << where().first << "/" << where().second
      << " view " << view_.round;
    return o.str();
  }

 private:
  static std::string id(int i) { return "n" + std::to_string(i); }

  FailoverNet net() {
    return {.connect = [this](const std::string& a) -> std::shared_ptr<RendezvousStore> {
              const int h = w_.node_at(a);
              return h == kNoNode ? nullptr : w_.link(i_, h);
            },
            .host = [this]() -> std::shared_ptr<RendezvousStore> {
              w_.hosted[i_] = Hosted{std::make_shared<MapStore>(), ++w_.incarnations};
              return w_.link(i_, i_);
            }};
  }

  void begin_failover(std::optional<std::string> follow) {
    if (!follow) view_.lost_hosts.push_back(host_id_);
    view_.generation = facts_.standing.generation;
    seek_.emplace(view_,
                  FailoverOptions{.node_id = id(i_),
                                  .addr = World::addr(i_),
                                  .port_suffix = ":1",
                                  .run_id = "model",
                                  .min_nodes = 1,
                                  .max_nodes = w_.n,
                                  .tries_per_candidate = 3},
                  net());
    if (follow) seek_->follow(*follow);
    phase_ = Phase::kSeeking;
    gate_.reset();
    arrived_ = -1;
  }

  void act() {
    switch (phase_) {
      case Phase::kRunning:
      case Phase::kTraining:
      case Phase::kWaiting: store_->add(key("hb/" + id(i_)), 1); return;  // a heartbeat
      case Phase::kSeeking: return seek();
      case Phase::kForming: return form();
      case Phase::kClosing: return close();
      case Phase::kStopped: return;
    }
  }

  void seek() {
    const auto status = seek_->step();
    if (status == Failover::Status::kGaveUp) {
      phase_ = Phase::kStopped;
      return;
    }
    if (status == Failover::Status::kSeeking) return;
    facts_ = seek_->facts();
    host_id_ = facts_.host_id;
    store_ = std::static_pointer_cast<Link>(seek_->store());
    phase_ = Phase::kForming;
    gate_.emplace(store_, view_.acquaintances, net(), World::addr(i_));
  }

  void form() {
    const int r = facts_.first_round;
    if (arrived_ < 0) {
      arrived_ = static_cast<int>(store_->add(round_key(r, "joined"), 1)) - 1;
      store_->set(round_key(r, "node" + std::to_string(arrived_)), record(i_));
      learn_view(r - 1);
      return;
    }
    if (const auto c = store_->try_get(round_key(r, "closed"))) return joined(std::stoi(*c));
    const auto count = std::stoi(store_->try_get(round_key(r, "joined")).value_or("0"));
    const auto quorum = std::stoi(store_->try_get(key("quorum")).value_or("0"));
    if (count >= quorum) {  // MIN 1; last call: any step may be the one after it
      gate_->begin();
      phase_ = Phase::kClosing;
      return;
    }
    switch (gate_->step()) {  // keep sweeping while waiting
      case FirstRoundGate::Status::kProbing: return;
      case FirstRoundGate::Status::kClear: gate_->begin(); return;
      case FirstRoundGate::Status::kYield: begin_failover(gate_->moved_to()); return;
    }
  }

  void close() {
    switch (gate_->step()) {
      case FirstRoundGate::Status::kProbing: return;
      case FirstRoundGate::Status::kYield: begin_failover(gate_->moved_to()); return;
      case FirstRoundGate::Status::kClear: break;
    }
    if (!gate_->settle()) return begin_failover(gate_->moved_to());
    const int r = facts_.first_round;
    const auto count = store_->try_get(round_key(r, "joined")).value_or("0");
    const std::string closed = store_->create_if_absent(round_key(r, "closed"), count);
    if (closed == count) {
      w_.closed_by_generation[facts_.standing.generation].insert({store_->host(), store_->incarnation()});
    }
    joined(std::stoi(closed));
  }

  // The first round closed with `closed` arrivals: a member trains, a later arrival waits for the next round.
  void joined(int closed) {
    const int r = facts_.first_round;
    if (arrived_ >= closed) {
      phase_ = Phase::kWaiting;
      return;
    }
    group_.clear();
    for (int a = 0; a < closed; ++a) {
      const auto rec = store_->try_get(round_key(r, "node" + std::to_string(a)));
      if (rec) group_.push_back(w_.node_at(nlohmann::json::parse(*rec).at("addr")));
    }
    view_.members.clear();
    for (int m : group_) view_.members.push_back({.id = id(m), .addr = World::addr(m), .record = record(m)});
    view_.round = r;
    phase_ = Phase::kTraining;
  }

  // As the rendezvous does on joining: a node that knows an older round learns the store's seeded one.
  void learn_view(int r) {
    if (view_.round >= r) return;
    const auto c = store_->try_get(round_key(r, "closed"));
    if (!c) return;
    view_.members.clear();
    for (int a = 0; a < std::stoi(*c); ++a) {
      const auto rec = store_->try_get(round_key(r, "node" + std::to_string(a)));
      if (!rec) return;
      const int m = w_.node_at(nlohmann::json::parse(*rec).at("addr"));
      view_.members.push_back({.id = id(m), .addr = World::addr(m), .record = record(m)});
    }
    view_.round = r;
  }

  World& w_;
  int i_;
  Phase phase_ = Phase::kRunning;
  FailoverView view_;
  std::string host_id_;
  std::shared_ptr<Link> store_;
  StoreFacts facts_;
  std::optional<Failover> seek_;
  std::optional<FirstRoundGate> gate_;
  int arrived_ = -1;
  std::vector<int> group_;
};

// A fault at a step of the schedule.
struct Fault {
  enum class Kind { kCrash, kCut, kHeal } kind;
  int a = 0, b = 0;  // the node (crash) or the link
};

struct Outcome {
  bool ok = true;
  std::string why;
};

class Model {
 public:
  // The issue-30 history: round 0 had nodes 0..n-1 on node 0's store; node 1
  // was cut off and round 1 closed without it; node 0's store is the one in use.
  explicit Model(int n) {
    w_.n = n;
    w_.alive.assign(n, true);
    w_.cut.assign(n, std::vector<bool>(n, false));
    w_.hosted.resize(n);
    w_.hosted[0] = Hosted{std::make_shared<MapStore>(), ++w_.incarnations};
    std::vector<int> all, newest;
    for (int i = 0; i < n; ++i) {
      all.push_back(i);
      if (i != 1) newest.push_back(i);
    }
    nodes_.reserve(static_cast<std::size_t>(n));  // nodes hand out pointers to themselves
    for (int i = 0; i < n; ++i) nodes_.emplace_back(w_, i);
    for (int i = 0; i < n; ++i) nodes_[i].start(i == 1 ? 0 : 1, i == 1 ? all : newest, 0);
  }

  void apply(const Fault& f) {
    switch (f.kind) {
      case Fault::Kind::kCrash: w_.alive[f.a] = false; return;
      case Fault::Kind::kCut:
        w_.cut[f.a][f.b] = w_.cut[f.b][f.a] = true;
        w_.partitioned_ever = true;
        return;
      case Fault::Kind::kHeal: w_.cut[f.a][f.b] = w_.cut[f.b][f.a] = false; return;
    }
  }
  void heal_all() {
    for (auto& row : w_.cut) row.assign(w_.n, false);
  }
  void step(int i) { nodes_[i].step(); }
  int size() const { return w_.n; }

  // No two full groups at once; without partitions, one closed first round per generation.
  Outcome check_safety() const {
    std::set<std::pair<int, int>> groups;
    for (const Node& node : nodes_) {
      if (node.phase() != Node::Phase::kTraining || !full(node)) continue;
      groups.insert(node.where());
    }
    if (groups.size() > 1) return {false, "two groups train at once: " + state()};
    if (!w_.partitioned_ever) {
      for (const auto& [g, stores] : w_.closed_by_generation) {
        const auto up = std::count_if(stores.begin(), stores.end(), [&](const auto& st) { return w_.up(st); });
        if (up > 1) return {false, "two live stores of generation " + std::to_string(g) + " closed: " + state()};
      }
    }
    return {};
  }

  // After faults stop: a training group holding a majority of the live nodes.
  Outcome check_progress() const {
    int live = 0;
    for (int i = 0; i < w_.n; ++i) live += w_.alive[i] ? 1 : 0;
    if (2 * live <= w_.n) return {};  // no majority left: stalling is allowed
    // A store whose first round closed forms its later rounds from the nodes
    // in it (MIN, no quorum): those training, and those waiting for its next
    // round (growth, or a member that came back after a partition).
    std::set<std::pair<int, int>> groups;
    std::map<std::pair<int, int>, int> in_store;
    for (int i = 0; i < w_.n; ++i) {
      if (!w_.alive[i]) continue;
      const auto phase = nodes_[i].phase();
      if (phase == Node::Phase::kTraining) groups.insert(nodes_[i].where());
      if (phase == Node::Phase::kTraining || phase == Node::Phase::kWaiting) ++in_store[nodes_[i].where()];
    }
    for (const auto& where : groups) {
      if (2 * in_store[where] > live) return {};
    }
    return {false, "no group of a majority of the " + std::to_string(live) + " live nodes: " + state()};
  }

  std::string state() const {
    std::string s;
    for (const Node& node : nodes_) s += node.describe() + (w_.alive[&node - nodes_.data()] ? " " : "(dead) ");
    return s;
  }

 private:
  // Whether every member of the node's group is alive and training in the same store.
  bool full(const Node& node) const {
    for (int m : node.group()) {
      if (!w_.alive[m] || nodes_[m].phase() != Node::Phase::kTraining || nodes_[m].where() != node.where()) {
        return false;
      }
    }
    return !node.group().empty();
  }
  World w_;
  std::vector<Node> nodes_;
};

// Runs one schedule: `order` says which node steps (or, for -1 - k, which
// fault k fires); then faults stop, links heal, and every node steps in turn.
Outcome run_schedule(int n, const std::vector<int>& order, const std::vector<Fault>& faults) {
  Model m(n);
  for (int x : order) {
    if (x < 0) {
      m.apply(faults[static_cast<std::size_t>(-1 - x)]);
    } else {
      m.step(x);
    }
    if (auto o = m.check_safety(); !o.ok) return o;
  }
  m.heal_all();
  for (int round = 0; round < 400; ++round) {
    for (int i = 0; i < n; ++i) m.step(i);
    if (auto o = m.check_safety(); !o.ok) return o;
  }
  return m.check_progress();
}

std::string describe(const std::vector<int>& order) {
  std::string s;
  for (int x : order) s += (x < 0 ? "F" + std::to_string(-1 - x) : std::to_string(x)) + " ";
  return s;
}

}  // namespace

// The issue-30 history, exhaustively over a bounded prefix: node 1 (cut off,
// excluded from round 1) and the others race after node 0 (the store host) is
// killed; the link to node 1 heals at every possible point of that race.
TEST(FailoverModel, PartitionedNodeThenStoreHostKilledConvergesInEveryInterleaving) {
  // Node 1's link is still down when node 0 is killed, and comes back at
  // every possible point of the race that follows.
  const std::vector<Fault> faults = {
      {Fault::Kind::kCut, 1, 2}, {Fault::Kind::kCrash, 0, 0}, {Fault::Kind::kHeal, 1, 2}};
  const int kPrefix = 10;  // steps of nodes 1 and 2, every sequence, before the rest runs round-robin
  const auto start = std::chrono::steady_clock::now();
  int schedules = 0;
  for (int mask = 0; mask < (1 << kPrefix); ++mask) {
    for (int heal_at = 0; heal_at <= kPrefix; ++heal_at) {
      std::vector<int> order = {-1, -2};
      for (int k = 0; k <= kPrefix; ++k) {
        if (k == heal_at) order.push_back(-3);
        if (k < kPrefix) order.push_back((mask >> k) & 1 ? 2 : 1);
      }
      const Outcome o = run_schedule(3, order, faults);
      ++schedules;
      ASSERT_TRUE(o.ok) << o.why << "\nschedule: " << describe(order);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[failover model] issue-30 history: " << schedules << " interleavings in " << seconds << " s"
            << std::endl;
}

// Random schedules over 3 and 4 nodes: crashes (of the store host, of its
// successors), partitions and heals at random points of the protocol.
TEST(FailoverModel, RandomCrashesPartitionsAndHealsKeepOneGroupAndProgress) {
  const char* env = std::getenv("DTRAIN_FAILOVER_SCHEDULES");
  const int count = env ? std::atoi(env) : 3000;
  const auto start = std::chrono::steady_clock::now();
  int crash_only = 0;
  for (int seed = 0; seed < count; ++seed) {
    std::mt19937 rng(static_cast<unsigned>(seed));
    const int n = 3 + seed % 2;
    std::vector<Fault> faults;
    std::vector<int> order;
    const bool partitions = seed % 3 != 0;
    crash_only += partitions ? 0 : 1;
    // The store host dies first or a few steps in; one more crash at most
    // (the store host lost twice in a row, when it hits the successor).
    std::uniform_int_distribution<int> node(0, n - 1), steps(20, 60);
    const int length = steps(rng);
    const int first_crash = std::uniform_int_distribution<int>(0, 5)(rng);
    for (int k = 0; k < length; ++k) {
      if (k == first_crash) {
        faults.push_back({Fault::Kind::kCrash, 0, 0});
        order.push_back(-static_cast<int>(faults.size()));
      }
      const int roll = std::uniform_int_distribution<int>(0, 99)(rng);
      if (roll < 4 && k > first_crash) {
        faults.push_back({Fault::Kind::kCrash, node(rng), 0});
        order.push_back(-static_cast<int>(faults.size()));
      } else if (partitions && roll < 12) {
        int a = node(rng), b = node(rng);
        if (a != b) {
          faults.push_back({roll < 9 ? Fault::Kind::kCut : Fault::Kind::kHeal, a, b});
          order.push_back(-static_cast<int>(faults.size()));
        }
      }
      order.push_back(node(rng));
    }
    const Outcome o = run_schedule(n, order, faults);
    ASSERT_TRUE(o.ok) << o.why << "\nseed " << seed << " n " << n << " schedule: " << describe(order);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[failover model] random: " << count << " schedules (" << crash_only << " crash-only) in " << seconds
            << " s" << std::endl;
}
