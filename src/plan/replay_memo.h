// Private to the planner: replays already done, kept by everything that
// determines them, so that a search replays each distinct (schedule, stage
// times, transfer time, blocking) once. See Note [Replay memo].
#pragma once

#include <cstddef>
#include <unordered_map>
#include <vector>

#include "dtrain/plan/cost_model.h"
#include "dtrain/plan/replay.h"

namespace dtrain::plan::detail {

class ReplayMemo {
 public:
  // Holds at most this many replays; when full, it starts again empty.
  static constexpr std::size_t kCapacity = 1024;

  // replay(program, options), from the memo when this program was replayed
  // with options equal to these bit for bit. The reference is valid until
  // the next call. `program` must outlive the memo (the schedule cache's
  // programs live as long as the process).
  const ReplayResult& replay(const ReplayProgram& program, const ReplayOptions& options);

 private:
  struct Entry {
    const ReplayProgram* program;
    ReplayOptions options;
    ReplayResult result;
  };
  std::unordered_multimap<std::size_t, Entry> entries_;  // by the hash of program and options
};

// estimate() with a memo for its replay (nullptr: none). Called only from
// one thread per memo.
PlanEstimate estimate(const ParallelPlan& plan, const ModelSpec& model, const Cluster& cluster,
                      const CostOptions& options, ReplayMemo* memo);

}  // namespace dtrain::plan::detail
