// Replays a pipeline schedule's action lists with real durations: when each
// rank finishes one training step's forwards and backwards, given per-stage
// times of F, I and W (B = I + W) and the time a point-to-point transfer takes.
//
// Execution model (the executor's, as in schedule.h): every rank runs its
// list in order; a compute action starts when the rank is free and its inputs
// are there (the previous stage's output, the next stage's gradient, its own
// forward, I before W); a SEND is asynchronous and free for the sender; a RECV
// waits until the matching send was issued plus the transfer time.
//
//   auto s = pipeline::make_schedule({.kind = ScheduleKind::k1F1B, .ranks = 4, .micro_batches = 8});
//   auto r = replay(s, {.stage = per_stage_costs, .p2p_seconds = 1e-4});
//   r.makespan;  // seconds from the first forward to the last backward
//
// A caller replaying one schedule many times (the planner's search) compiles
// it once and replays the program (Note [Compiled replay] in replay.cpp):
//
//   const auto program = compile_replay(s);
//   auto r = replay(program, {.stage = per_stage_costs, .p2p_seconds = 1e-4});
#pragma once

#include <cstdint>
#include <vector>

#include "dtrain/parallel/pipeline/schedule.h"

namespace dtrain::plan {

struct StageTimes {
  double forward = 0;          // F of one micro-batch
  double backward_input = 0;   // I (with recompute, if any)
  double backward_weight = 0;  // W; B = I + W
};

struct ReplayOptions {
  std::vector<StageTimes> stage;  // one per stage (Schedule::stage_count())
  double p2p_seconds = 0;         // one activation or gradient transfer
  // The sender waits for its transfer to finish (Megatron-LM 2021 waited on
  // its batch_isend_irecv requests); false: sends are free for the sender.
  bool blocking_sends = false;
};

struct ReplayResult {
  double makespan = 0;
  std::vector<double> busy;  // per rank: seconds of compute
  std::vector<double> end;   // per rank: when its last action finished
  // Per rank: most micro-batches held (forward done, backward not), summed
  // over the rank's stages; as SimulationResult::peak_in_flight, but a count
  // over the rank's own order, which no duration changes.
  std::vector<int> peak_in_flight;
};

// A schedule's actions in an order in which each one's inputs come before
// it, each naming the earlier steps it waits for: what a replay needs of the
// schedule, worked out once. Independent of any duration.
struct ReplayProgram {
  enum class Op : std::uint8_t { kForward, kBackward, kWeight, kSend, kRecv };
  struct Step {
    Op op = Op::kForward;
    std::uint32_t rank = 0;
    std::uint32_t duration = 0;  // index into the replay's table: stage * 4 + (F, B, I, W)
    // Earlier steps whose finishing time this one waits for (1 + their
    // index; 0: none, time 0). kForward, kWeight, kRecv read `after`,
    // kBackward the later of both.
    std::uint32_t after = 0, also_after = 0;
  };
  int ranks = 0, stages = 0;
  std::vector<Step> steps;
  std::vector<int> peak_in_flight;  // per rank, as ReplayResult's
};

// InternalError if the schedule stalls (validate() proves generated
// schedules cannot deadlock).
ReplayProgram compile_replay(const pipeline::Schedule& schedule);

ReplayResult replay(const ReplayProgram& program, const ReplayOptions& options);
// compile_replay, then replay: for one replay of a schedule.
ReplayResult replay(const pipeline::Schedule& schedule, const ReplayOptions& options);

}  // namespace dtrain::plan
