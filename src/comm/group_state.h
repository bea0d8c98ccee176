// Private to src/comm/: the c10d objects and the state behind dtrain's comm
// handles (Store, ProcessGroup, Work). Nothing outside src/comm/ includes
// this or any c10d process-group, backend or store header.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/traffic.h"
#include "dtrain/log.h"

namespace dtrain {
class SerialExecutor;
}

namespace dtrain::dist {
namespace detail {

class SharedMemoryTransport;
class SharedMemoryP2P;
struct FlightCounters;

struct StoreImpl {
  c10::intrusive_ptr<c10d::Store> store;
  int port = 0;
  std::string where;  // "host:port" or "in-memory store", for messages
  // Round trips made through this connection and every prefixed view of it
  // (dist::round_trips, store_keys.h).
  std::shared_ptr<std::atomic<std::int64_t>> round_trips = std::make_shared<std::atomic<std::int64_t>>(0);
};

// Whether a group's eligible CPU collectives use shared memory; see Note
// [Transport choice] in collectives.cpp.
enum class SharedMemoryState { kUndecided, kDeciding, kOn, kOff };

struct GroupState {
  c10::intrusive_ptr<c10d::Backend> backend;
  int rank = 0;
  int size = 1;
  BackendKind kind = BackendKind::kGloo;
  c10::Device device = c10::Device(c10::kCPU);
  std::chrono::milliseconds timeout{0};
  std::string name;
  std::vector<int> world_ranks;
  // The rank identity of the thread that made the group: errors raised on
  // other threads (Gloo's, executors') carry it.
  log::Identity identity;
  // This group's slice of the store; subgroups take keys below it.
  Store store{nullptr};
  GroupOptions options;
  int subgroups_created = 0;

  // Shared memory, set up at the first eligible collective (collectives.cpp).
  SharedMemoryState shm_state = SharedMemoryState::kUndecided;
  std::unique_ptr<SharedMemoryTransport> shm;
  std::unique_ptr<SerialExecutor> shm_executor;  // runs shared-memory collectives in issue order
  // Point-to-point through shared memory for peers on this host (shm_p2p.h);
  // null for NCCL groups, one-rank groups, or with intra_host_shared_memory off.
  std::unique_ptr<SharedMemoryP2P> p2p;

  // dist::traffic(): ops and bytes per OpKind (relaxed; any thread).
  std::array<std::atomic<std::int64_t>, 2 * kOpKinds> traffic{};
  // Sequence numbers for the flight recorder; null while it is off.
  std::unique_ptr<FlightCounters> flight;

  // Out of line: the transport's types are complete only in collectives.cpp.
  GroupState();
  ~GroupState();
};

// Renames a group made by new_group: the mesh names its groups after their
// dimensions ("tp", "dp_shard+cp") for errors and flight-recorder dumps.
void rename_group(GroupState& state, std::string name);

// "gloo group 'world' (rank 1 of 4)", for messages.
std::string describe(const GroupState& state);

// What an operation was, for its error messages; self-contained (no
// reference to the group), so completion callbacks on Gloo's or an
// executor's threads never own the group: the last owner letting go there
// would make the group join those very threads.
struct OpInfo {
  std::string op;     // "all_reduce", "recv", ...
  int peer = -1;      // group rank of the peer of a point-to-point op
  std::string sizes;  // "float[1024]", "float[2048] -> float[1024]"
  // Filled in by make_work / make_future_work from the group:
  std::string group;  // describe(group)
  log::Identity identity;
  std::chrono::milliseconds timeout{0};
  // The flight recorder's ticket (flight_recorder.h); 0: not recorded.
  std::uint64_t flight = 0;
  // NCCL groups: the backend to abort when the operation fails (Note
  // [Abort instead of hang], work.cpp); empty otherwise. Weak: an operation
  // never keeps its group alive.
  std::optional<c10::weak_intrusive_ptr<c10d::Backend>> abort_backend;
};
std::string describe_tensor(const at::Tensor& tensor);

// The CommunicationError for `info` failing with `cause`, built under the
// group's rank identity (any thread may raise it). An empty hint: "a peer
// may have died" (naming the peer of a point-to-point operation).
std::exception_ptr communication_error(const OpInfo& info, const std::string& cause, const std::string& hint = "");
std::exception_ptr communication_error(const GroupState& group, OpInfo info, const std::string& cause,
                                       const std::string& hint = "");
// Maps any exception from c10d or a transport to communication_error();
// dtrain errors that already name the operation pass through.
std::exception_ptr translate(const OpInfo& info, std::exception_ptr error);

}  // namespace detail

inline const c10::intrusive_ptr<c10d::Store>& c10d_store(const Store& store) {
  return store.impl()->store;
}

namespace detail {
// How an operation ended, shared by its Work and its future's callback.
struct Outcome {
  OpInfo info;
  // What future() completes with (the output tensor, or a TensorList).
  c10::IValue result;
  // Runs once after success, before anyone sees the result (copy-back of a
  // coalesced buffer, the division of an average).
  std::function<void()> finish;
  std::mutex mutex;
  bool done = false;
  std::exception_ptr error;
  bool aborted = false;  // the backend was aborted for this error (once; under `mutex`)
  // Held by Work::wait() around the backend's wait, never by a future()'s
  // continuation: one waiter at a time (Gloo's send/recv wait consumes one
  // completion; a second concurrent waiter would wait out the timeout).
  std::mutex wait_mutex;
  // Records how it ended (runs finish on success) unless already recorded.
  void settle(std::exception_ptr failure);
};
}  // namespace detail

struct Work::Impl {
  // Exactly one of: a c10d operation; a future of ours (shared memory, or a
  // coalesced operation's parts collected).
  c10::intrusive_ptr<c10d::Work> work;
  Future future;
  std::shared_ptr<detail::Outcome> outcome;
};

namespace detail {
// A Work for a c10d operation issued by `issue` (its exceptions translated).
Work make_work(const std::shared_ptr<GroupState>& group, OpInfo info, c10::IValue result,
               const std::function<c10::intrusive_ptr<c10d::Work>()>& issue, std::function<void()> finish = {});
// A Work completed through `future` (which completes with `result` or an error).
Work make_future_work(const std::shared_ptr<GroupState>& group, OpInfo info, Future future,
                      std::function<void()> finish = {});
}  // namespace detail

}  // namespace dtrain::dist
