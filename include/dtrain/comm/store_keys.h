// Deleting and counting a store's keys and its round trips, reading a key
// that may be absent and setting several at once, for protocols that clean
// up after themselves and count their cost (the fault-tolerance lighthouse,
// src/ft/lighthouse.cpp) and the tests that check they do. Kept apart from store.h, which most of dtrain
// includes, since only these few need them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/store.h"

namespace dtrain::dist {

// Removes `key` (under the store's prefix); false when it was absent.
bool delete_key(Store& store, const std::string& key);
// How many keys the whole store holds, every prefix included.
std::int64_t num_keys(Store& store);
// The round trips to its server made so far through `store`'s connection
// (every prefixed view of it shares the count), counted as a TCPStore client
// makes them: one per call, two for a get and for a wait that timed out. For
// protocols that count their cost per step (docs/fault_tolerance.md).
std::int64_t round_trips(const Store& store);
// The value of `key`, or nullopt when it is absent, in one round trip (a
// get waits for the key first, a check and a get take three); values must
// not be the single byte '\0'.
std::optional<std::string> get_if_present(Store& store, const std::string& key);
// Sets every key to its value in one round trip (TCPStore's multiSet).
void multi_set(Store& store, const std::vector<std::string>& keys, const std::vector<std::string>& values);

}  // namespace dtrain::dist
