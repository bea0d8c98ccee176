// TrainerOptions::fault_tolerance: the Trainer's loop as one fault-tolerant
// replica group (docs/fault_tolerance.md). Every step joins the lighthouse's
// quorum, averages the gradients over the quorum's replica groups after the
// strategy's own reduction, and applies the update only when every member's
// step succeeded (ft::FaultTolerantReplicas); a replica group that starts
// behind (restarted by `dtrain run --ft-replicas`) receives the parameters,
// optimizer state, GradScaler, learning-rate schedule and step counter of a
// live peer before it joins, and goes on from that step.
//
//   dtrain::Trainer trainer(strategy, optimizer, stream,
//                           {.max_steps = 1000, .fault_tolerance = dtrain::TrainerFaultTolerance{}});
//
// Contracts: the batch source is a StepStream (its batches a function of the
// step, so a recovered replica knows its data position from the step); rank
// r of replica group g reads data rank g * W + r of G * W (W the strategy's
// data world, G the replica groups), so groups train on different data and a
// down group's share of a step is not trained on. The strategy's
// replica_state() is copied rank to rank (module()'s parameters for single
// device and DDP; ZeRO's chunks and sharded optimizer state). Checkpoints
// (TrainerOptions::checkpoint_dir) are written by one replica group, the
// lowest of each quorum, and a restart of the whole job resumes every group
// from them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "dtrain/ft/lighthouse.h"
#include "dtrain/ft/quorum.h"

namespace dtrain {

// The reference run of a fault-tolerant job (tests, audits): no lighthouse;
// step s averages the gradients of the replica groups members[s], each
// computed by this run's ranks on that group's data (rank r: data rank
// g * W + r of replicas * W), summed in the order given and divided by their
// count, as the quorum's all-reduce does. Run with the same strategy over
// the same number of ranks as one replica group of the job, and the
// membership the job recorded (the sample log's "members"), it ends, bit for
// bit, where every replica group of the job ended.
struct TrainerFtReplay {
  int replicas = 1;                       // replica groups of the job
  std::vector<std::vector<int>> members;  // per step, from 0: at least max_steps entries
};

struct TrainerFaultTolerance {
  // Where the lighthouse is and which replica group this is; nullopt: from
  // the environment `dtrain run --ft-replicas N` sets (ft::lighthouse_from_env).
  std::optional<ft::LighthouseEndpoint> lighthouse;
  // The client's timeouts and heartbeat (its replica_id is the endpoint's).
  ft::LighthouseClientOptions client;
  // Each quorum's group: rendezvous and operation timeout (a member that died
  // between the quorum and the group fails that step, which runs again).
  std::chrono::milliseconds group_timeout{std::chrono::seconds(10)};
  // Set: more than this many steps in a row that abort stop the Trainer
  // with a CommunicationError (ft::FaultTolerantOptions::max_retries);
  // unset: retry without limit.
  std::optional<int> max_retries;
  // Called on every rank after each committed step with that step (0-based)
  // and its quorum: the replica groups whose gradients it averaged.
  std::function<void(std::int64_t step, const ft::Quorum& quorum)> on_commit;
  // Called on every rank when this replica group loaded a live peer's state;
  // `step` is the step it goes on from.
  std::function<void(std::int64_t step)> on_recover;
  // Set: replay a recorded membership instead (no lighthouse, nothing above
  // applies).
  std::optional<TrainerFtReplay> replay;
};

}  // namespace dtrain
