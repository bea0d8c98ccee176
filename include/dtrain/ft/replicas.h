// Fault-tolerant replica groups: the gradient all-reduce across the replica
// groups of the mesh's dp_replicate dimension, over a group re-formed each
// step from the lighthouse's quorum, with a commit vote and live recovery.
// See docs/fault_tolerance.md.
//
//   ft::LighthouseClient client(ft::lighthouse_from_env().candidates, {.replica_id = r});
//   ft::FaultTolerantReplicas replicas(client, ft::module_and_optimizer_state(model, optimizer));
//   while (replicas.step() < steps) {
//     replicas.start_step();                       // quorum; recovers here if behind
//     auto batch = data(replicas.step(), r);       // the data position is the step
//     optimizer.zero_grad(); loss(model, batch).backward();
//     replicas.all_reduce_gradients(grads);        // mean over the quorum's replicas
//     if (replicas.should_commit()) optimizer.step();   // all members commit, or none
//   }
//   replicas.finish();                             // or FaultTolerantOptions::max_steps
//
// Semantics: a step's gradient is the mean over the replicas in its quorum,
// so while a replica is down the effective batch of a step shrinks to the
// survivors'. A step commits only when every member's all-reduce succeeded
// (Note [Commit vote] in src/ft/lighthouse_client.cpp); an aborted step is
// run again, same step number, same data. A replica that joins behind (a
// restarted process, a new one, one that missed a commit) receives the
// state of an up-to-date member over the quorum's group before the step:
// parameters, optimizer state, whatever ReplicaState saves, and the step
// counter. No checkpoint is read; no step is lost or repeated.
//
// A replica group may have several ranks (FaultTolerantOptions::replica_group)
// that reduce among themselves first (a plain all-reduce, DDP, or ZeRO,
// whose shards are then averaged; pipelines inside are not tested yet:
// docs/fault_tolerance.md, Limits).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/ft/lighthouse.h"

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize
namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace dtrain::ft {

// What an up-to-date replica hands a recovering one: save() on the source,
// load() on the receiver, into state of the same structure. The step counter
// travels alongside (FaultTolerantReplicas keeps it).
struct ReplicaState {
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(torch::serialize::InputArchive&)> load;
};

// A module's parameters and buffers (copied into the receiver's own tensors,
// so references to them stay valid) and an optimizer's state; `extra` adds
// more under the same archive (a GradScaler, a data position).
ReplicaState module_and_optimizer_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                        ReplicaState extra = {});

struct FaultTolerantOptions {
  // The ranks of this replica group when it has more than one (its world
  // group under dtrain run --ft-replicas): its rank 0 talks to the
  // lighthouse and shares the quorum and the commit decision with the
  // others; rank i of every replica group forms the cross-replica group of
  // local rank i, and recovers from rank i of its source (so each rank's
  // own state, shards included, is copied rank to rank). Every rank of the
  // replica group makes the same calls. A replica group's internal
  // collectives are not fault-tolerant: a rank that fails takes its group
  // down (the launcher restarts all of it).
  std::optional<dist::ProcessGroup> replica_group;
  // Rendezvous and operation timeout of each quorum's group. A member that
  // died between the quorum and the group's making fails the step within the
  // lighthouse's heartbeat timeout instead (LighthouseClient::await_members).
  std::chrono::milliseconds group_timeout{std::chrono::seconds(10)};
  // See GroupOptions::intra_host_shared_memory. With it, the all-reduce sums
  // in member order on every rank (the tests' bitwise reference relies on
  // that); replicas on several hosts use Gloo.
  bool intra_host_shared_memory = true;
  // The steps the caller trains (0: not known). Below it, should_commit()
  // asks for the next step's quorum as soon as a step commits, so the
  // lighthouse forms it while the caller applies the update; start_step()
  // then only waits for the answer. A caller that stops before max_steps
  // leaves its last request answered: its peers' next step fails at the
  // group (group_timeout) and aborts, as if it had died mid-step.
  std::int64_t max_steps = 0;
  // Live recovery sends the state in chunks of at most this many bytes
  // (Note [Live recovery] in src/ft/replicas.cpp); both sides need not agree
  // (the source announces its chunk size).
  std::int64_t recovery_chunk_bytes = 1 << 20;
  // After a committed step (its next request asked ahead: max_steps above),
  // start_step() does not wait for the quorum's answer: it is read in
  // all_reduce_gradients() (or should_commit()), so the lighthouse forms it
  // while the caller's forward and backward run. quorum() is then the last
  // step's until the all-reduce. When the answer is not that quorum again (a
  // member dropped or joined, one behind), the step's gradients are dropped,
  // should_commit() returns false without a vote, and the next start_step()
  // goes on in the new quorum: the step runs again, as after an abort (Note
  // [Quorum read at the all-reduce] in src/ft/replicas.cpp). The Trainer
  // turns it on.
  bool overlap_quorum = false;
  // Set: should_commit() throws a CommunicationError once more than this
  // many steps in a row aborted (the commit vote failed), as torchft's
  // Manager(max_retries=...); a commit resets the count, and a step run
  // again because a new quorum was read at the all-reduce (overlap_quorum:
  // a member joined or left) neither counts nor resets. A failure that
  // repeats every step (a member that reaches the lighthouse but never
  // completes the all-reduce, a group that cannot be made) then stops the
  // replica with what failed last, instead of retrying forever. The
  // members that were in the quorum for all of those steps saw the same
  // votes, so they give up at the same step; nothing of the aborted steps
  // is applied. Unset (the default): retry without limit.
  std::optional<int> max_retries;
  // all_reduce_gradients() leaves the mean in its flat buffer and replaces
  // each of `tensors` by the view of it there, instead of copying the mean
  // back (one pass over the gradients less a step: Note [Gradients as views
  // of the flat buffer] in src/ft/replicas.cpp). The caller makes those
  // views its parameters' gradients and must drop them (zero_grad setting
  // them to none, as LibTorch's optimizers do) before the next backward:
  // the buffer is written again by the next step's all-reduce. For a caller
  // whose gradients nothing else holds (the Trainer sets it for a replica
  // group of one process without DDP or ZeRO, whose buckets and shards hold
  // them).
  bool gradients_as_buffer_views = false;
};

// Where this replica's calls spent their time, summed over its steps
// (milliseconds of wall clock): what fault tolerance adds to a step beyond
// the caller's forward, backward and optimizer step. FaultTolerantReplicas
// logs them when destroyed (docs/fault_tolerance.md, "Where the time goes").
struct FaultTolerantTimes {
  std::int64_t steps = 0;    // start_step() calls
  double quorum_ms = 0;      // the quorum, its answer's wait and read (start_step(), or at the all-reduce)
  double group_ms = 0;       // start_step(): making a new quorum's group
  double recovery_ms = 0;    // start_step() and after: live recovery, either side
  double flatten_ms = 0;     // all_reduce_gradients(): gradients into the flat buffer
  double all_reduce_ms = 0;  // all_reduce_gradients(): issuing and waiting for the all-reduce
  double unflatten_ms = 0;   // all_reduce_gradients(): the mean back into the gradients
  double vote_ms = 0;        // should_commit(): the commit vote
  double ask_ahead_ms = 0;   // should_commit(): asking for the next quorum
};

class FaultTolerantReplicas {
 public:
  // `client` and the state's tensors must outlive this object.
  FaultTolerantReplicas(LighthouseClient& client, ReplicaState state, FaultTolerantOptions options = {});
  ~FaultTolerantReplicas();

  // Joins this step's quorum, makes its group when the quorum id changed,
  // and recovers (this replica behind) or sends state (a recovering member
  // was assigned to it). Failures of the group or of the transfer are not
  // thrown: the step then votes to abort. TimeoutError when the lighthouse
  // does not answer.
  void start_step();
  // In place: the mean of `tensors` over the quorum's members (one flat
  // all-reduce); with gradients_as_buffer_views, `tensors` are replaced by
  // views of the mean instead, once it succeeded. Failures of the group and the all-reduce are recorded, not
  // thrown (see should_commit). With overlap_quorum the step's quorum may be
  // read here, so the lighthouse's errors that start_step() throws
  // (TimeoutError, CommunicationError when no candidate is left,
  // TrainingFinishedError, ReplicaStateLostError) may come from here and
  // from should_commit(), on every rank of a replica group alike.
  void all_reduce_gradients(std::vector<at::Tensor>& tensors);
  // The commit vote: true when every member's step succeeded; then apply
  // the optimizer step. step() counts the committed steps.
  bool should_commit();

  // Before the first start_step(): this replica's state is that of
  // committed step `step` (a checkpoint it resumed from, after a restart of
  // the whole job); the quorum then sees it at that step.
  void resume_at(std::int64_t step);
  // The training is done (called by should_commit() when step() reaches
  // FaultTolerantOptions::max_steps; call it after the loop otherwise): a
  // replica group that asks later, behind, is told so
  // (TrainingFinishedError) instead of waiting for a peer that left.
  void finish();

  std::int64_t step() const { return step_; }
  const Quorum& quorum() const { return quorum_; }
  int replica_id() const { return client_.replica_id(); }
  // Whether this step's start_step() loaded a peer's state.
  bool recovered() const { return recovered_; }
  // Why this step will not commit (its group, the live recovery or the
  // all-reduce failed: what, and the error), or empty.
  const std::string& failure() const { return failure_; }
  const FaultTolerantTimes& times() const { return times_; }

 private:
  // The quorum of this step: asks (or reads the answer asked ahead) and, in
  // a replica group of several ranks, shares rank 0's answer with the others.
  Quorum join_quorum(std::int64_t agreed, std::int64_t newest);
  // Makes quorum_'s group when its id changed, then recovers or serves.
  void enter_quorum();
  // Stops the thread of a request asked ahead that will not be read (the
  // LighthouseClient serves one thread at a time).
  void drop_asked_ahead();
  // Reads the answer start_step() left pending (overlap_quorum): the step
  // goes on when it is the last quorum again; otherwise it is held for the
  // next start_step() and this step is redone.
  void settle_quorum();
  // This step's answer: the one read ahead, or asked now (rank 0).
  Quorum ask_quorum();
  void make_group();
  // Work::wait(), with the live members watched (Note [Collectives on a
  // silent member]); on a silent member, keeps the group in retired_ and
  // throws.
  void wait_watching_members(dist::Work& work, const std::string& what);
  // Recovers from the quorum member `source`, or sends this replica's state
  // to the members it serves: issued here, waited in finish_serving().
  void recover_or_serve();
  void recover_from(int source);
  // Waits for the state sends issued by recover_or_serve() (each wait bounded
  // by the group timeout); a failure fails the step. Called before the
  // gradient all-reduce, the vote and the next step.
  void finish_serving();
  void fail(const std::string& what, const std::exception& e);
  // One more step aborted (why: for the error); throws past
  // FaultTolerantOptions::max_retries.
  void count_uncommitted(const std::string& why);
  bool shared_by_ranks() const { return options_.replica_group && options_.replica_group->size() > 1; }
  int local_rank() const { return options_.replica_group ? options_.replica_group->rank() : 0; }

  LighthouseClient& client_;
  ReplicaState state_;
  FaultTolerantOptions options_;
  std::int64_t step_ = 0;
  Quorum quorum_;
  // The state sends of this step's live recovery while they run. Declared
  // before group_, so destroyed after it: a Gloo send's Work owns its buffer,
  // which the group's threads may still use until the group is gone.
  struct Serving {
    std::vector<dist::Work> sends;
    std::vector<int> peers;  // replica ids
    std::int64_t bytes = 0;
    double serialise_ms = 0;
    double issued_ms = 0;  // serialising and issuing the sends: what start_step cost
    std::chrono::steady_clock::time_point began;
  };
  Serving serving_;
  std::optional<dist::ProcessGroup> group_;
  std::int64_t group_quorum_id_ = -1;
  // Groups whose collective was abandoned on a silent member, with that
  // collective's future: destroyed once it ends (at its own timeout), since
  // destroying a group joins its threads, which wait in it.
  std::vector<std::pair<dist::ProcessGroup, dist::Future>> retired_;
  std::string failure_;
  bool failed_ = false;      // this step's group, transfer or all-reduce failed
  bool want_fresh_ = false;  // ask the next quorum for a fresh group
  bool recovered_ = false;
  bool asked_ahead_ = false;     // the last commit asked for this step's quorum
  bool answer_pending_ = false;  // start_step() left it to settle_quorum()
  bool redo_ = false;            // settle_quorum() found another quorum: this step runs again
  int uncommitted_ = 0;          // steps aborted in a row (FaultTolerantOptions::max_retries)
  std::optional<Quorum> held_;   // that quorum, for the next start_step()
  // Rank 0's request asked ahead and its answer, read on a thread of their
  // own (overlap_quorum): the store's round trips leave the caller's thread.
  std::future<Quorum> ahead_;
  // The all-reduce's flat buffer, kept across steps.
  at::Tensor flat_;
  FaultTolerantTimes times_;
};

}  // namespace dtrain::ft
