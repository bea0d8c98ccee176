// A quorum: the replica groups that take part in one training step, as the
// lighthouse decides it (see Note [Quorum protocol] in src/ft/lighthouse.cpp).
// Plain data with a one-line text form, so the lighthouse, its clients and
// tests exchange and record it without LibTorch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::ft {

struct QuorumMember {
  int replica_id = 0;
  // A number the lighthouse gives each registration of a replica id: a
  // replica restarted under the same id is a new incarnation (a new process
  // whose groups must be made afresh).
  std::int64_t incarnation = 0;
  // The steps this replica has committed when it joined.
  std::int64_t step = 0;
  friend bool operator==(const QuorumMember&, const QuorumMember&) = default;
};

struct Quorum {
  // Rounds count the quorums the lighthouse formed (one per step attempt).
  std::int64_t round = 0;
  // Changes whenever the members (replica ids or incarnations) change, or a
  // member asked for a fresh group; members of one quorum id share one
  // process group.
  std::int64_t quorum_id = 0;
  std::vector<QuorumMember> members;  // sorted by replica id

  // The member's index (its rank in the quorum's group), -1 when absent.
  int index_of(int replica_id) const;
  std::int64_t max_step() const;
  // Members behind max_step(): they recover before the step.
  std::vector<int> behind() const;
  // The member (an index into members) that sends its state to the member at
  // `index`, which is behind: the up-to-date members take the recovering ones
  // in turn, so two recoveries load two sources where there are two.
  int recovery_source(int index) const;
  // "round 7, quorum 3: replicas 0 (step 12), 1 (step 12), 3 (step 0)".
  std::string describe() const;
  // One line: "7 3 0:1:12 1:2:12 3:5:0".
  std::string to_text() const;
  // Throws InternalError on a malformed line.
  static Quorum from_text(const std::string& text);
};

}  // namespace dtrain::ft
