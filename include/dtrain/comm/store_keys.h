// Deleting and counting a store's keys, for protocols that clean up after
// themselves (the fault-tolerance lighthouse, src/ft/lighthouse.cpp) and the
// tests that check they do. Kept apart from store.h, which most of dtrain
// includes, since only these few need them.
#pragma once

#include <cstdint>
#include <string>

#include "dtrain/comm/store.h"

namespace dtrain::dist {

// Removes `key` (under the store's prefix); false when it was absent.
bool delete_key(Store& store, const std::string& key);
// How many keys the whole store holds, every prefix included.
std::int64_t num_keys(Store& store);

}  // namespace dtrain::dist
