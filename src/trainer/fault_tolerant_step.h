// The Trainer's side of TrainerOptions::fault_tolerance (include/dtrain/
// trainer/fault_tolerance.h): the lighthouse client and the replicas of one
// fit(), and what a live recovery copies besides the model and optimizer
// (the GradScaler and the learning-rate schedule). Private to the Trainer.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dtrain/ft/replicas.h"
#include "dtrain/trainer/fault_tolerance.h"
#include "dtrain/trainer/lr_schedule.h"
#include "dtrain/trainer/strategy.h"

namespace dtrain {
namespace amp {
class GradScaler;
}

namespace detail {

// TrainerFaultTolerance::replay: fills the strategy's gradients for step
// `step` as the recorded quorum's all-reduce made them. `compute(data_rank)`
// runs the step's forward and backward on one member group's data (after
// zero_grad) and returns its loss; the members' gradients are summed in the
// recorded order and divided by their count. Returns the last member's loss.
at::Tensor replay_gradients(const TrainerFtReplay& replay, std::int64_t step, Strategy& strategy,
                            torch::optim::Optimizer& optimizer,
                            const std::function<at::Tensor(int data_rank)>& compute);
// ConfigError unless `replay` covers `max_steps` steps with members in range.
void check_replay(const TrainerFtReplay& replay, std::int64_t max_steps);

class FaultTolerantStep {
 public:
  // Connects to the lighthouse (registration waits for the first step).
  // `scaler` and `schedule` (either may be null) travel in a recovery; they,
  // the strategy and the optimizer must outlive this object. `max_steps`:
  // the Trainer's, so each committed step below it asks for the next quorum
  // at once (FaultTolerantOptions::max_steps).
  FaultTolerantStep(const TrainerFaultTolerance& options, Strategy& strategy, torch::optim::Optimizer& optimizer,
                    amp::GradScaler* scaler, std::shared_ptr<ScheduledLR> schedule, std::int64_t max_steps);
  ~FaultTolerantStep();

  // This rank's data position over every replica group's ranks.
  int data_rank() const;
  int data_world() const;

  // Joins the quorum of the next step attempt; returns the step it runs:
  // `committed` (the steps this group has committed), or the live peer's
  // after a recovery (the state is then loaded).
  std::int64_t begin(std::int64_t committed);
  // After backward: the gradients' mean over the quorum and the commit vote;
  // true when the step is to be applied (by every member alike).
  bool commit(std::int64_t step);
  // Before the first begin(): the Trainer resumed from a checkpoint at
  // committed step `step` (a restart of the whole job).
  void resume_at(std::int64_t step) { replicas_->resume_at(step); }
  // After a committed step: whether this replica group writes the job's
  // checkpoints, as the lowest replica id of the step's quorum. One member
  // of each quorum, the same on every rank of its group.
  bool writes_checkpoints() const;
  // Runs `write` (the strategy's save of checkpoint step `step`, on every
  // rank of this group); returns whether it was written. A write that fails
  // (a full disk, a folder that cannot be made) does not fail the group: it
  // is logged as a warning and training goes on, since the replica groups
  // hold the state live (Note [Failed checkpoint writes]). A failure of the
  // group itself (CommunicationError, TimeoutError) is thrown.
  bool save_checkpoint(std::int64_t step, const std::function<void()>& write);
  // The replica ids of the last quorum, in its order (the committed step's
  // membership after commit() returned true).
  std::vector<int> members() const;
  int replica_id() const { return endpoint_.replica_id; }
  // The job's replica groups (--ft-replicas), not the live quorum's: what
  // numbers each rank's files stably across quorums.
  int replicas() const { return endpoint_.replicas; }

 private:
  TrainerFaultTolerance options_;
  Strategy& strategy_;
  ft::LighthouseEndpoint endpoint_;
  std::unique_ptr<ft::LighthouseClient> client_;
  std::unique_ptr<ft::FaultTolerantReplicas> replicas_;
};

}  // namespace detail
}  // namespace dtrain
