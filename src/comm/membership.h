// Private: the check-in every rank performs through the store before a
// backend connects. See Note [Membership check] in membership.cpp.
#pragma once

#include <chrono>
#include <string>

#include "dtrain/comm/store.h"

namespace dtrain::dist::detail {

struct CheckIn {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::string group;        // group name, for messages
  std::string fingerprint;  // must agree across ranks (e.g. a subgroup's rank list); may be empty
};

// Returns once all `size` ranks have checked in with a consistent view.
// Throws RendezvousError (disagreement, duplicate rank) or TimeoutError
// (ranks missing, listed by number).
void check_in(Store& store, const CheckIn& me);

}  // namespace dtrain::dist::detail
