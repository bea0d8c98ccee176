// Membership check performed through the store before a backend connects.
//
// Note [Membership check]
// Gloo and NCCL connect by waiting on store keys; a rank that disagrees about
// the world size, or that never arrives, makes the others wait for the full
// (often 30-minute) timeout and then fail with an opaque message. So every
// rank first checks in:
//   1. claim its rank number: `add(claim/R, 1)` > 1 means two processes claim R;
//   2. rank 0 publishes its view (`view` = size + fingerprint); the others read
//      it and compare with their own. A rank that disagrees, or whose rank is
//      not below rank 0's size, records the problem under `error` and throws;
//   3. only a rank that agrees increments `joined`; everyone then waits until
//      `joined` reaches the size, or `error` appears, or time runs out.
// Because a disagreeing rank never counts as joined, a correct rank cannot
// pass step 3 with a bad peer in the group: it sees `error` instead.
#include "membership.h"

#include <algorithm>
#include <chrono>
#include <sstream>
#include <thread>

#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain::dist::detail {
namespace {
using Clock = std::chrono::steady_clock;

std::string view_of(const CheckIn& me) {
  return std::to_string(me.size) + "|" + me.fingerprint;
}

using log::format_seconds;

[[noreturn]] void fail(Store& store, const std::string& message, const std::string& hint) {
  store.set("error", message + " Hint: " + hint);
  throw RendezvousError(message, hint);
}

void throw_if_error(Store& store, const CheckIn& me) {
  if (store.check({"error"})) {
    throw RendezvousError("group '" + me.group + "' cannot form: " + store.get("error"));
  }
}

// Polls until `ready()` or the deadline; rethrows a peer's recorded error.
template <typename Ready>
bool poll_until(Store& store, const CheckIn& me, Clock::time_point deadline, Ready ready) {
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    throw_if_error(store, me);
    if (ready()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}
}  // namespace

void check_in(Store& store, const CheckIn& me) {
  const auto deadline = Clock::now() + me.timeout;
  const std::string mine = view_of(me);

  if (store.add("claim/" + std::to_string(me.rank), 1) > 1) {
    fail(store, "two processes claim rank " + std::to_string(me.rank) + " of group '" + me.group + "'.",
         "give every process a distinct RANK (a stale worker from an earlier run may still be alive)");
  }
  store.set("arrived/" + std::to_string(me.rank), mine);

  if (me.rank == 0) store.set("view", mine);
  const bool published = poll_until(store, me, deadline, [&] { return store.check({"view"}); });
  if (!published) {
    throw TimeoutError("rank 0 of group '" + me.group + "' did not check in within " + format_seconds(me.timeout) + ".",
                       "start rank 0, or check that all ranks use the same MASTER_ADDR/MASTER_PORT");
  }
  const std::string theirs = store.get("view");
  if (theirs != mine) {
    const auto size0 = theirs.substr(0, theirs.find('|'));
    if (size0 != std::to_string(me.size)) {
      fail(store,
           "ranks disagree on the size of group '" + me.group + "': rank 0 has " + size0 + ", rank " +
               std::to_string(me.rank) + " has " + std::to_string(me.size) + ".",
           "launch every rank with the same WORLD_SIZE");
    }
    fail(store,
         "ranks disagree on the members of group '" + me.group + "': rank 0 has [" +
             theirs.substr(theirs.find('|') + 1) + "], rank " + std::to_string(me.rank) + " has [" + me.fingerprint +
             "].",
         "call new_group with the same rank list on every rank");
  }

  store.add("joined", 1);
  const bool complete =
      poll_until(store, me, deadline, [&] { return store.add("joined", 0) >= static_cast<std::int64_t>(me.size); });
  if (!complete) {
    std::string missing;
    int count = 0;
    for (int r = 0; r < me.size; ++r) {
      if (!store.check({"arrived/" + std::to_string(r)})) {
        if (count++ < 16) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    if (count > 16) missing += ", ...";
    throw TimeoutError("only " + std::to_string(me.size - count) + " of " + std::to_string(me.size) +
                           " ranks of group '" + me.group + "' checked in within " + format_seconds(me.timeout) +
                           "; missing: [" + missing + "].",
                       "start the missing ranks, or raise the timeout (DTRAIN_TIMEOUT_SECONDS)");
  }
}

}  // namespace dtrain::dist::detail
