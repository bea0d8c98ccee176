// Private to src/comm/: the flight recorder's ring (see the public
// include/dtrain/comm/flight_recorder.h and Note [Flight recorder] in
// flight_recorder.cpp) and the hook every ProcessGroup operation calls.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/comm/flight_recorder.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/traffic.h"

namespace dtrain::dist::detail {

struct GroupState;
struct OpInfo;

enum class FlightState { kEnqueued, kStarted, kCompleted, kFailed };

// A group as the dumps name it (one per group, shared by its entries).
struct FlightGroup {
  std::string name;  // GroupOptions::name; the mesh dimension(s) for mesh groups
  std::string backend;
  int rank = 0;  // this rank's rank in the group
  std::vector<int> world_ranks;
};

// What a group keeps for the recorder: its identity and its counters (per
// group, so every rank numbers a group's collectives alike; point-to-point
// ops per peer and direction, so rank a's send #k to b is b's recv #k from a).
struct FlightCounters {
  std::shared_ptr<const FlightGroup> group;
  std::mutex mutex;
  std::uint64_t collectives = 0;
  std::vector<std::uint64_t> sends, recvs;  // by peer
};

class FlightRecorder {
 public:
  // The process's recorder, or nullptr when off: the one branch an
  // operation pays then. Made (and SIGUSR1 taken) at the first call with
  // DTRAIN_FLIGHT_RECORDER > 0; never destroyed, so threads may use it at exit.
  static FlightRecorder* get();

  struct Op {
    std::shared_ptr<const FlightGroup> group;
    std::uint64_t seq = 0;
    std::string op;  // "all_reduce(sum)", "send", ...
    int peer = -1;   // group rank of a point-to-point op's peer
    std::string sizes, dtype;
    std::int64_t bytes = 0;
  };
  // Records `op` as enqueued now; returns its ticket (never 0).
  std::uint64_t record(Op op);
  // Moves the entry of `ticket` to `state` (forward only; a no-op for ticket
  // 0 or an entry already overwritten). Any thread.
  void mark(std::uint64_t ticket, FlightState state);
  // Writes the ring (see dump_flight_recorder). `after_failure`: skipped when
  // the last such dump is less than a second old.
  std::string dump(const std::string& reason, bool after_failure = false);

  struct Ring;

 private:
  explicit FlightRecorder(int entries, std::string dir);
  std::unique_ptr<Ring> ring_;
};

// Counts an operation in its group's traffic and, with the recorder on,
// records it and stores the ticket in info.flight. Called once per operation
// by the ProcessGroup method that issues it, before it is issued.
void note_issue(GroupState& group, OpInfo& info, OpKind kind, const at::Tensor& tensor, std::int64_t bytes);

}  // namespace dtrain::dist::detail
