// Store-host failover: finding or hosting the next store, and deciding whether
// a failover store's first round may close.
//
// Note [Store-host failover]
// The store lives in the agent of the node the endpoint names. When that node
// is lost, the others go on with a store of the next generation.
// - What every node knows (FailoverView). The last closed round it learned:
//   number, restart count, the members' records in node-rank order; the ids
//   of store hosts it knows lost; and its acquaintances, every address it
//   saw in a round or hosting a store.
// - Detection. A store operation of the rendezvous fails with
//   CommunicationError (the host's process is gone: connection reset; or the
//   client's timeout under a partition). The entry point then fails over.
// - Seeking (Failover). A survivor walks its view's members in node-rank
//   order, skipping lost hosts. When the candidate is itself, it hosts
//   generation G+1 at its own address and the endpoint's port and seeds it:
//   run id, --nnodes, its view round as closed (with the members' records,
//   so that a node that never saw that round can read it) and ended by a
//   membership change, the quorum, and its standing -- `view` (the round it
//   was seeded from), `generation`, `host` (addr:port) -- with `generation`
//   written last. Otherwise it connects to the candidate and joins only a
//   seeded store that is not behind it: one whose view is at least its own,
//   or whose first round has already closed. A store that yielded says
//   "moved <addr>" and is followed. A candidate gets some tries, then the
//   next one is tried; the walk repeats until --rdzv-timeout.
// - Why survivors can disagree. Under a partition the host may close a round
//   without a node that is cut off (the issue-30 history: node 1 cut off,
//   round 1 closed with nodes 0 and 2, then node 0 killed). Node 2 (view 1)
//   and node 1 (view 0) then each find themselves first in their own view
//   and both host generation 1. Views cannot be made to agree before hosting
//   (no store is up to exchange them through), so competing stores find
//   each other afterwards and all but one yield.
// - Yielding (FirstRoundGate). A failover store's first round has a fate,
//   `settled`, decided once by create-if-absent: "closed" or "moved <addr>".
//   Whoever closes the first round first sweeps every acquaintance's address
//   for a competing failover store, then settles "closed"; nodes waiting in
//   the first round keep sweeping. A competitor whose first round closed, or
//   that outranks this store (newer view, then newer generation, then lower
//   address: Standing, read from the stores themselves, so everyone ranks
//   alike), wins: this store settles "moved <its addr>" and its nodes follow.
//   A competitor this store outranks is told so: its `settled` is set to
//   "moved <this addr>" unless it closed first (then this one yields).
// - Invariants (checked by tests/unit/failover_model_test.cpp over thousands
//   of interleavings of crashes, partitions and heals):
//   (1) At most one store of a generation closes its first round, among
//       stores whose hosts are acquainted and reachable during the sweeps:
//       both closing would need each one's sweep to miss the other, and the
//       later host's sweep starts after the earlier store was up. Across a
//       partition the quorum keeps the sides apart: the first round closes
//       only with MIN nodes and a strict majority of the seeding round's
//       members, so a minority side never trains.
//   (2) A majority of live, connected nodes always forms a round: once
//       faults stop, every node's walk reaches a live candidate or hosts,
//       the sweeps leave one unmoved store, every other store points to it,
//       and its first round gets the majority.
// - A minority partition: its nodes host or join a store that cannot reach
//   the quorum; they keep sweeping, and if the partition heals before
//   --rdzv-timeout they follow the majority's store (waiting for its next
//   round, which a running group admits as growth). Otherwise they stop
//   with a RendezvousError saying why (no split brain). A 2-node job whose
//   store host dies therefore stops (1 of 2 is no majority) unless
//   --rdzv-conf failover_quorum=min trades that guarantee for availability.
// - The round after a failover is a membership change: no restart is used,
//   and training resumes from the last checkpoint. The workers' store needs
//   nothing new: node rank 0 of each round hosts it. Authentication carries
//   over: the successor gates its store with the same secret.
// Limits: a partition that cuts a node off from a store that is still alive
// looks, to that node, like a lost host; it joins back only by restarting.
// Two stores that closed their first rounds on the two sides of a partition
// (each with a quorum of a different view) are not merged. New nodes know
// only --rdzv-endpoint: after a failover they can join only if the endpoint
// is a name that follows the host (a Kubernetes Service, DNS).
// Tests: tests/unit/failover_model_test.cpp (the protocol, exhaustively, and
// the issue-30 history), Elastic.LosingTheStoreHostIsSurvivedByTheOthers,
// Elastic.StoreHostLossIsSurvivedAcrossNetworkNamespaces,
// Elastic.AStoreHostLossWithoutMajorityStopsUnlessQuorumIsMin, and the chaos
// soak (bench/chaos).
#include "failover.h"

#include <algorithm>

#include "rendezvous_keys.h"

namespace dtrain::elastic::detail {
namespace {

constexpr int kMaxFollows = 8;  // "moved" chains are short; this only guards against a cycle
const std::string kMovedPrefix = "moved ";

std::optional<std::string> moved_target(const std::optional<std::string>& settled) {
  if (!settled || settled->rfind(kMovedPrefix, 0) != 0) return std::nullopt;
  return settled->substr(kMovedPrefix.size());
}

}  // namespace

bool Standing::outranks(const Standing& other) const {
  if (view != other.view) return view > other.view;
  if (generation != other.generation) return generation > other.generation;
  return host < other.host;
}

std::optional<StoreFacts> read_facts(RendezvousStore& store) {
  const auto generation = store.try_get(key("generation"));  // written last
  if (!generation) return std::nullopt;
  StoreFacts f;
  f.standing.generation = std::stoi(*generation);
  f.standing.view = std::stoi(store.try_get(key("view")).value_or("-1"));
  f.standing.host = store.try_get(key("host")).value_or("");
  f.addr = store.try_get(key("host_addr")).value_or("");
  f.host_id = store.try_get(key("host_id")).value_or("");
  f.first_round = std::stoi(store.try_get(key("first_round")).value_or("0"));
  f.settled = store.try_get(key("settled"));
  return f;
}

int failover_quorum(std::size_t members, bool quorum_min) {
  return quorum_min ? 0 : static_cast<int>(members) / 2 + 1;
}

Failover::Failover(FailoverView view, FailoverOptions options, FailoverNet net)
    : view_(std::move(view)), opt_(std::move(options)), net_(std::move(net)) {}

void Failover::follow(const std::string& addr) {
  following_ = addr;
  tries_ = 0;
}

void Failover::next_candidate() {
  ++candidate_;
  tries_ = 0;
}

void Failover::give_up_on_candidate() {
  if (following_) {
    following_.reset();
    tries_ = 0;
  } else {
    next_candidate();
  }
}

std::string Failover::target() const {
  if (following_) return "follow " + *following_;
  return std::to_string(passes_) + "/" + std::to_string(candidate_);
}

bool Failover::tried_enough() {
  return opt_.tries_per_candidate > 0 && ++tries_ >= opt_.tries_per_candidate;
}

Failover::Status Failover::step() {
  if (following_) {
    const std::string addr = *following_;
    auto s = addr == opt_.addr ? nullptr : net_.connect(addr);
    if (s && accept(s, /*followed=*/true)) return Status::kJoined;
    if (following_ == addr && tried_enough()) give_up_on_candidate();
    return Status::kSeeking;
  }
  auto lost = [&](const std::string& id) {
    return std::find(view_.lost_hosts.begin(), view_.lost_hosts.end(), id) != view_.lost_hosts.end();
  };
  // Lost hosts are skipped, unless every other member is lost too: a host
  // lost to a partition may be back, and its store is then joined again.
  const bool anyone = std::any_of(view_.members.begin(), view_.members.end(),
                                  [&](const FailoverView::Member& m) { return !lost(m.id); });
  while (anyone && candidate_ < view_.members.size() && lost(view_.members[candidate_].id)) ++candidate_;
  if (candidate_ >= view_.members.size()) {
    if (opt_.max_passes > 0 && ++passes_ >= opt_.max_passes) return Status::kGaveUp;
    candidate_ = 0;
    tries_ = 0;
    return Status::kSeeking;
  }
  const FailoverView::Member& c = view_.members[candidate_];
  if (c.id == opt_.node_id) {
    if (auto s = net_.host()) {
      seed(*s);
      store_ = std::move(s);
      return Status::kHosting;
    }
    problem_ = "cannot host at " + opt_.addr + opt_.port_suffix + " (the port is taken)";
  } else if (auto s = net_.connect(c.addr)) {
    if (accept(s, /*followed=*/false)) return Status::kJoined;
    if (following_) return Status::kSeeking;  // it moved: follow it next
  } else {
    problem_ = "nothing answers at " + c.addr + opt_.port_suffix;
  }
  if (tried_enough()) next_candidate();
  return Status::kSeeking;
}

bool Failover::accept(const std::shared_ptr<RendezvousStore>& candidate, bool followed) {
  const auto facts = read_facts(*candidate);
  if (!facts) {
    problem_ = "the store there is not a seeded failover store (yet)";
    return false;
  }
  if (const auto to = moved_target(facts->settled)) {
    if (follows_++ < kMaxFollows) follow(*to);
    problem_ = "the store there moved to " + *to;
    return false;
  }
  const bool established = facts->settled.has_value();  // "closed"
  if (!followed && !established && facts->standing.view < view_.round) {
    problem_ = "the store there was seeded from round " + std::to_string(facts->standing.view) + ", older than round " +
               std::to_string(view_.round) + " this node knows";
    return false;
  }
  store_ = candidate;
  facts_ = *facts;
  return true;
}

void Failover::seed(RendezvousStore& next) {
  const int r = view_.round;
  const int generation = view_.generation + 1;
  next.set(key("run_id"), opt_.run_id);
  next.set(key("nnodes"), std::to_string(opt_.min_nodes) + ":" + std::to_string(opt_.max_nodes));
  next.set(key("first_round"), std::to_string(r + 1));
  // The view round, as ended by the loss: the next one counts restarts from it
  // and uses none; its records let a node that never saw it learn it.
  for (std::size_t i = 0; i < view_.members.size(); ++i) {
    next.set(round_key(r, "node" + std::to_string(i)), view_.members[i].record);
  }
  next.set(round_key(r, "joined"), std::to_string(view_.members.size()));
  next.set(round_key(r, "closed"), std::to_string(view_.members.size()));
  next.set(round_key(r, "restarts"), std::to_string(view_.restarts));
  next.set(round_key(r, "end"), encode({.kind = RoundEnding::Kind::kMembershipChange,
                                        .reason = "the node hosting the rendezvous store was lost"}));
  next.set(key("quorum"), std::to_string(failover_quorum(view_.members.size(), opt_.quorum_min)));
  facts_ = {.standing = {.view = r, .generation = generation, .host = opt_.addr + opt_.port_suffix},
            .addr = opt_.addr,
            .host_id = opt_.node_id,
            .first_round = r + 1};
  next.set(key("view"), std::to_string(r));
  next.set(key("host"), facts_.standing.host);
  next.set(key("host_addr"), opt_.addr);
  next.set(key("host_id"), opt_.node_id);
  next.set(key("generation"), std::to_string(generation));  // last: clients take the store once it is seeded
}

FirstRoundGate::FirstRoundGate(std::shared_ptr<RendezvousStore> own, std::vector<std::string> acquaintances,
                               FailoverNet net, std::string own_addr)
    : own_(std::move(own)), net_(std::move(net)), own_addr_(std::move(own_addr)) {
  for (auto& a : acquaintances) {
    if (a != own_addr_ && std::find(addresses_.begin(), addresses_.end(), a) == addresses_.end()) {
      addresses_.push_back(std::move(a));
    }
  }
}

void FirstRoundGate::begin() {
  next_ = 0;
}

FirstRoundGate::Status FirstRoundGate::step() {
  if (moved()) return Status::kYield;
  if (next_ >= addresses_.size()) return Status::kClear;
  const std::string addr = addresses_[next_++];
  const auto other = net_.connect(addr);
  if (!other) return Status::kProbing;
  const auto theirs = read_facts(*other);
  const auto mine = read_facts(*own_);
  if (!theirs || !mine || theirs->standing.host == mine->standing.host || moved_target(theirs->settled)) {
    return Status::kProbing;  // not a competitor, this store itself, or one that yielded already
  }
  const bool they_win = theirs->settled.has_value() || theirs->standing.outranks(mine->standing);
  if (they_win) return yield_to(theirs->addr) ? Status::kYield : Status::kProbing;
  // Tell the competitor to move here, unless its first round closed meanwhile.
  const std::string fate = other->create_if_absent(key("settled"), kMovedPrefix + own_addr_);
  if (!moved_target(fate)) return yield_to(theirs->addr) ? Status::kYield : Status::kProbing;
  return Status::kProbing;
}

bool FirstRoundGate::yield_to(const std::string& where) {
  const std::string fate = own_->create_if_absent(key("settled"), kMovedPrefix + where);
  const auto to = moved_target(fate);
  if (to) moved_to_ = *to;
  return to.has_value();  // false: this store's first round closed first
}

bool FirstRoundGate::settle() {
  const std::string fate = own_->create_if_absent(key("settled"), "closed");
  if (const auto to = moved_target(fate)) {
    moved_to_ = *to;
    return false;
  }
  return true;
}

bool FirstRoundGate::moved() {
  const auto to = moved_target(own_->try_get(key("settled")));
  if (to) moved_to_ = *to;
  return to.has_value();
}

}  // namespace dtrain::elastic::detail
