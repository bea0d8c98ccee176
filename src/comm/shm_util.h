// Private to src/: what the shared-memory transports (collectives in
// shm_transport.cpp, point-to-point in shm_p2p.cpp) share: futex waits on
// words in memory mapped by several processes, the host identity that
// decides whether two ranks can share memory, the liveness check of a peer
// process, and the rings' names (which the launcher sweeps). No LibTorch:
// part of dtrain_base, which `dtrain run` links.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace dtrain::dist::detail {

static_assert(std::atomic<std::uint32_t>::is_always_lock_free && sizeof(std::atomic<std::uint32_t>) == 4,
              "futex words must be plain 32-bit integers");

// Shared (not FUTEX_PRIVATE) futex operations: the word may live in memory
// mapped by several processes. futex_wait returns after a wake, a change of
// the word from `expected`, a signal, or `timeout`.
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::microseconds timeout);
void futex_wake_all(std::atomic<std::uint32_t>* word);

// Equal on two ranks exactly when they run on one host (same host name and
// boot id) in one pid namespace, so that /dev/shm is shared and pids compare.
std::uint64_t host_identity();

// A process that exited (gone, or a zombie not yet reaped) will never arrive.
bool process_gone(std::int64_t pid);

// The name prefix of every /dev/shm file process `pid` makes:
// "/dev/shm/dtrain-<pid>-" (then "comm-..." for a group's collective region,
// shm_transport.cpp; "p2p-..." for a point-to-point ring, shm_p2p.cpp).
std::string shm_file_prefix(std::int64_t pid);

// Removes the files `pid` made that are still there. Each is unlinked once
// every rank that needs it mapped it, so what is left came from a rank that
// died before its peers mapped it, or from a ring no receiver came for. The
// launcher calls this once every rank of a round has exited, when nobody can
// map them any more. Returns how many files went.
int remove_shared_memory_of(std::int64_t pid);

}  // namespace dtrain::dist::detail
