// Pipeline schedules as data: what every rank does, in order, during one
// training step, as a list of actions that can be printed, checked and
// tested before anything runs (torch.distributed.pipelining's action lists).
//
//   auto s = dtrain::pipeline::make_schedule({.kind = ScheduleKind::k1F1B, .ranks = 4, .micro_batches = 8});
//   dtrain::pipeline::validate(s);        // throws ConfigError on a broken schedule
//   std::cout << dtrain::pipeline::to_table(s);
//
// The model is cut into ranks * stages_per_rank stages; stage s lives on rank
// s % ranks ("loop" placement, as Megatron and torch place interleaved
// stages), so with one stage per rank stage s is rank s. Per micro-batch i the
// work is F(s, i) on every stage in order, then backward in reverse order:
// either B(s, i) (input and weight gradients together) or, in zero-bubble
// schedules, I(s, i) (input gradient: what the previous stage waits for)
// and later W(s, i) (weight gradients, free to fill idle time).
//
// Communication appears as actions too, each named by the stage on the rank
// doing it: SEND_F(s, i) (stage s's output) matches RECV_F(s+1, i) (stage
// s+1's input); SEND_B(s, i) (the gradient of stage s's input) matches
// RECV_B(s-1, i) (the gradient of stage s-1's output). Between two stages on
// the same rank (p = 1 with interleaving) nothing is sent.
//
// Execution model (what validate() simulates and the executor does): sends
// are asynchronous and complete by themselves; a receive blocks until the
// matching send has been issued; compute actions block on nothing but their
// inputs. See Note [Schedule validation] in schedule.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::pipeline {

enum class ActionKind : std::uint8_t {
  kForward,         // F: forward of micro-batch i on stage s
  kBackward,        // B: full backward (input and weight gradients)
  kBackwardInput,   // I: gradient w.r.t. the stage's input only (keeps the graph)
  kBackwardWeight,  // W: gradients w.r.t. the stage's parameters (after I)
  kSendActivation,  // SEND_F: stage s's output for micro-batch i to stage s+1
  kRecvActivation,  // RECV_F: stage s's input for micro-batch i from stage s-1
  kSendGradient,    // SEND_B: gradient of stage s's input to stage s-1
  kRecvGradient,    // RECV_B: gradient of stage s's output from stage s+1
};
// "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B".
std::string to_string(ActionKind kind);

struct Action {
  ActionKind kind = ActionKind::kForward;
  int stage = 0;  // the stage whose F/B/I/W this is, or which sends / receives
  int micro = 0;  // micro-batch index

  bool operator==(const Action&) const = default;
  bool is_compute() const { return kind <= ActionKind::kBackwardWeight; }
};
// "F3.1" = forward of micro-batch 1 on stage 3, "SEND_F3.1", ...
std::string to_string(const Action& action);

enum class ScheduleKind : std::uint8_t {
  kGPipe,            // all forwards, then all backwards
  k1F1B,             // warm-up forwards, then one forward / one backward
  kInterleaved1F1B,  // 1F1B over stages_per_rank > 1 stages per rank
  kZeroBubble,       // ZB-H1: 1F1B with backward split in I and W, W filling idle time
};
std::string to_string(ScheduleKind kind);
// "gpipe", "1f1b", "interleaved", "zb"; ConfigError otherwise.
ScheduleKind parse_schedule_kind(const std::string& name);

struct ScheduleOptions {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int ranks = 1;            // p
  int stages_per_rank = 1;  // v (interleaving); > 1 only for interleaved and zero bubble
  int micro_batches = 1;    // m
};

struct Schedule {
  ScheduleOptions options;
  // actions[r]: rank r's actions in order.
  std::vector<std::vector<Action>> actions;

  int stage_count() const { return options.ranks * options.stages_per_rank; }
  int rank_of_stage(int stage) const { return stage % options.ranks; }
  // The stages of `rank`, in model order.
  std::vector<int> stages_of_rank(int rank) const;
};

// Generates a schedule (already validated). Throws ConfigError for options
// that make no sense (m < 1, v > 1 for GPipe or 1F1B, ...).
Schedule make_schedule(const ScheduleOptions& options);

// The schedule's compute order with communication added where consecutive
// stages live on different ranks (what make_schedule does after ordering
// compute): RECV before a compute that needs remote data, SEND after one that
// produces it.
Schedule add_communication(ScheduleOptions options, const std::vector<std::vector<Action>>& compute);

struct SimulationResult {
  // Time slots, in units where F = I = W = 1 and B = 2: when each rank's
  // compute actions start (parallel to Schedule::actions, -1 for comms).
  std::vector<std::vector<int>> start;
  int makespan = 0;
  // Idle share of the ranks' time between 0 and the makespan.
  double bubble_fraction = 0;
  // Per rank: most micro-batches whose forward ran and whose backward (B, or W
  // when split) has not yet, summed over the rank's stages: activations held.
  std::vector<int> peak_in_flight;
};

// Checks the schedule by simulating it, and throws ConfigError naming the
// first problem: a compute action missing or repeated, one whose inputs are
// never produced, a send without its receive (or the reverse), a transfer
// between a rank and itself, or a deadlock (every unfinished rank waiting,
// with each one's blocking action listed). See Note [Schedule validation].
SimulationResult validate(const Schedule& schedule);

// One row per rank, one column per time slot of the simulation ("F0.1",
// "I1.0", ... and "." for idle), then the simulated bubble and peak activations.
std::string to_table(const Schedule& schedule);

}  // namespace dtrain::pipeline
