// Training with uneven inputs: ranks that run out of batches early keep
// shadowing the collectives of the ranks still training, so nobody hangs.
//
//   dtrain::Join join({&ddp.joinable()});
//   for (auto& batch : my_batches) { ...ddp(batch)...; loss.backward(); opt.step(); }
//   join.finish();  // returns once every rank has run out of batches
//
// Semantics follow torch.distributed.algorithms.Join with DDP's default
// divide_by_initial_world_size: while a rank is joined it contributes zero
// gradients, and each bucket is divided by the group's (initial) size, so a
// step's gradient is the sum over the ranks still training divided by the
// whole world size. finish() then makes the final model the same on every
// rank, copying it from the last rank to join.
#pragma once

#include <c10/core/Device.h>

#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain {

struct JoinConfig {
  bool enable = false;
  bool throw_on_early_termination = false;
  bool is_first_joinable = false;
};

// Something with per-iteration collectives that Join can shadow.
class Joinable {
 public:
  virtual ~Joinable() = default;
  // One iteration's collectives, run by a rank that has joined while others still train.
  virtual void join_main_hook() = 0;
  // Runs once all ranks have joined; `is_last_joiner` is true on the ranks that joined last.
  virtual void join_post_hook(bool is_last_joiner) = 0;
  virtual dist::ProcessGroup& join_group() = 0;
  virtual c10::Device join_device() const = 0;

  const JoinConfig& join_config() const { return join_config_; }
  // Called before the per-iteration collectives of the first joinable: an
  // all-reduce of 1 that tells the join context this rank still trains.
  // Returns its Work (empty when not inside a Join). With
  // throw_on_early_termination, throws once any rank has run out of inputs.
  dist::Work notify_join_context();

 private:
  friend class Join;
  JoinConfig join_config_;
};

struct JoinOptions {
  bool enable = true;
  // Instead of shadowing, make every rank throw once one rank runs out of inputs.
  bool throw_on_early_termination = false;
};

class Join {
 public:
  explicit Join(std::vector<Joinable*> joinables, JoinOptions options = {});
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;
  // Detaches the joinables; does not communicate (call finish() for that).
  ~Join();
  // Call when this rank has no more inputs: shadows the others' iterations
  // until all ranks are here, then runs the post hooks.
  void finish();

 private:
  std::vector<Joinable*> joinables_;
  JoinOptions options_;
  bool finished_ = false;
};

}  // namespace dtrain
