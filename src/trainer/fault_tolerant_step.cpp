// The Trainer's fault-tolerant step (src/trainer/fault_tolerant_step.h).
//
// Note [Checkpoints of replica groups]
// After a committed step every member of its quorum holds the same state, so
// one replica group writing it is enough: the member with the lowest replica
// id (every member knows the quorum, so exactly one decides to write, and
// all ranks of that group decide alike). It writes through the Trainer's
// Checkpointer over its own ranks: the usual commit protocol (every part,
// then MANIFEST last), so a group killed mid-write leaves no checkpoint at
// that step and the previous ones intact. The next checkpoint step is then
// written by the next lowest live group. The folder is the job's: a restart
// of the whole job (every group) resumes every group from the newest
// checkpoint and the quorum starts at its step; a single restarted group
// also reads it, is behind its live peers, and recovers from them as usual.
//
// Note [Failed checkpoint writes]
// Under fault tolerance a checkpoint is a fallback for a whole-job restart,
// not the state training goes on from: every member of the quorum holds that
// state live. So a write that fails (ENOSPC on a full disk, most often) is a
// warning, not a failure of the writing group: had it thrown, the launcher
// would restart the group, which would recover live, be the lowest replica id
// again and fail the next write the same way, each time costing a restart.
// The Checkpointer's commit protocol makes the skip safe: its ranks agree
// after every phase, so every rank of the group throws at the same phase and
// goes on alike (no rank is left inside a collective), the temporary folder
// is removed and the previous checkpoints stay untouched. The step is not
// marked saved, so the next checkpoint step (or the end) writes again.
// CommunicationError and TimeoutError still escape: they mean a rank of the
// group is gone or stuck, and the group must restart.
#include "fault_tolerant_step.h"

#include <ATen/core/ivalue.h>
#include <torch/serialize/archive.h>

#include "dtrain/amp/grad_scaler.h"
#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain {

namespace {

// The Trainer's state beyond the model and optimizer, as JSON strings (the
// same texts its checkpoints keep).
ft::ReplicaState trainer_extra_state(amp::GradScaler* scaler, std::shared_ptr<ScheduledLR> schedule) {
  const bool with_scaler = scaler != nullptr && scaler->is_enabled();
  return {.save =
              [scaler, schedule, with_scaler](torch::serialize::OutputArchive& archive) {
                if (with_scaler) archive.write("trainer/grad_scaler", c10::IValue(amp::to_json(*scaler->state_dict())));
                if (schedule) archive.write("trainer/lr_schedule", c10::IValue(schedule->to_json()));
              },
          .load =
              [scaler, schedule, with_scaler](torch::serialize::InputArchive& archive) {
                c10::IValue text;
                if (with_scaler) {
                  archive.read("trainer/grad_scaler", text);
                  scaler->load_state_dict(amp::grad_scaler_state_from_json(text.toStringRef()));
                }
                if (schedule) {
                  archive.read("trainer/lr_schedule", text);
                  schedule->load_json(text.toStringRef());
                }
              }};
}

// The gradients the cross-replica mean runs on: those of every tensor the
// optimizer steps (Strategy::parameters(): ZeRO's shards; a pipeline's stage
// parameters and the borrowed copies of tied weights, which gradients()
// leaves out since the norm counts each tie once, but which are stepped, so
// a copy not averaged over the quorum would drift from its owner).
std::vector<at::Tensor> defined_gradients(Strategy& strategy) {
  std::vector<at::Tensor> grads;
  for (const auto& p : strategy.parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  return grads;
}

}  // namespace

ft::ReplicaState Strategy::replica_state(torch::optim::Optimizer& optimizer, ft::ReplicaState extra) {
  return ft::module_and_optimizer_state(module(), optimizer, std::move(extra));
}

namespace detail {

void check_replay(const TrainerFtReplay& replay, std::int64_t max_steps) {
  DTRAIN_CHECK(
      static_cast<std::int64_t>(replay.members.size()) >= max_steps, ConfigError,
      "the fault-tolerance replay records " << replay.members.size() << " steps, the Trainer runs " << max_steps << ".",
      "give the membership of every step, or lower max_steps");
  for (std::size_t s = 0; s < replay.members.size(); ++s) {
    DTRAIN_CHECK(!replay.members[s].empty(), ConfigError, "the replay's step " << s << " has no members.",
                 "every committed step has at least one replica group");
    for (const int m : replay.members[s]) {
      DTRAIN_CHECK(m >= 0 && m < replay.replicas, ConfigError,
                   "the replay's step " << s << " names replica group " << m << " of " << replay.replicas << ".",
                   "set TrainerFtReplay::replicas to the job's --ft-replicas");
    }
  }
}

at::Tensor replay_gradients(const TrainerFtReplay& replay, std::int64_t step, Strategy& strategy,
                            torch::optim::Optimizer& optimizer,
                            const std::function<at::Tensor(int data_rank)>& compute) {
  const auto& members = replay.members.at(static_cast<std::size_t>(step));
  std::vector<at::Tensor> sum;
  at::Tensor loss;
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (i > 0) strategy.zero_grad(optimizer);
    loss = compute(members[i] * strategy.data_world() + strategy.data_rank());
    const auto grads = defined_gradients(strategy);
    if (i == 0) {
      for (const auto& g : grads) sum.push_back(g.clone());
      continue;
    }
    DTRAIN_INTERNAL_ASSERT(grads.size() == sum.size(), "replica group " << members[i] << " has " << grads.size()
                                                                        << " gradients at step " << step << ", "
                                                                        << members[0] << " " << sum.size());
    for (std::size_t j = 0; j < sum.size(); ++j) sum[j].add_(grads[j]);
  }
  const auto grads = defined_gradients(strategy);
  for (std::size_t j = 0; j < sum.size(); ++j) {
    if (members.size() > 1) sum[j].div_(static_cast<std::int64_t>(members.size()));
    grads[j].copy_(sum[j]);
  }
  return loss;
}

FaultTolerantStep::FaultTolerantStep(const TrainerFaultTolerance& options, Strategy& strategy,
                                     torch::optim::Optimizer& optimizer, amp::GradScaler* scaler,
                                     std::shared_ptr<ScheduledLR> schedule, std::int64_t max_steps)
    : options_(options),
      strategy_(strategy),
      endpoint_(options.lighthouse ? *options.lighthouse : ft::lighthouse_from_env()) {
  auto client_options = options_.client;
  client_options.replica_id = endpoint_.replica_id;
  client_ = std::make_unique<ft::LighthouseClient>(endpoint_.candidates, client_options);
  std::optional<dist::ProcessGroup> group = strategy_.group();
  if (group && group->size() == 1) group.reset();
  replicas_ = std::make_unique<ft::FaultTolerantReplicas>(
      *client_, strategy_.replica_state(optimizer, trainer_extra_state(scaler, std::move(schedule))),
      ft::FaultTolerantOptions{.replica_group = group,
                               .group_timeout = options_.group_timeout,
                               .max_steps = max_steps,
                               .overlap_quorum = true,
                               .max_retries = options_.max_retries,
                               .gradients_as_buffer_views = !group && strategy_.gradients_replaceable()});
}

FaultTolerantStep::~FaultTolerantStep() = default;

int FaultTolerantStep::data_rank() const {
  return endpoint_.replica_id * strategy_.data_world() + strategy_.data_rank();
}

int FaultTolerantStep::data_world() const {
  return endpoint_.replicas * strategy_.data_world();
}

std::int64_t FaultTolerantStep::begin(std::int64_t committed) {
  DTRAIN_INTERNAL_ASSERT(replicas_->step() == committed, "the Trainer is at step " << committed << ", replica group "
                                                                                   << endpoint_.replica_id << " at "
                                                                                   << replicas_->step());
  replicas_->start_step();
  if (replicas_->recovered() && options_.on_recover) options_.on_recover(replicas_->step());
  return replicas_->step();
}

bool FaultTolerantStep::commit(std::int64_t step) {
  std::vector<at::Tensor> params;
  for (const auto& p : strategy_.parameters()) {
    if (p.grad().defined()) params.push_back(p);
  }
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const auto& p : params) grads.push_back(p.grad());
  replicas_->all_reduce_gradients(grads);
  // gradients_as_buffer_views: the mean's views (the same tensors otherwise).
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!grads[i].is_same(params[i].grad())) params[i].mutable_grad() = grads[i];
  }
  if (!replicas_->should_commit()) return false;
  if (options_.on_commit) options_.on_commit(step, replicas_->quorum());
  return true;
}

std::vector<int> FaultTolerantStep::members() const {
  std::vector<int> ids;
  for (const auto& m : replicas_->quorum().members) ids.push_back(m.replica_id);
  return ids;
}

bool FaultTolerantStep::save_checkpoint(std::int64_t step, const std::function<void()>& write) {
  try {
    write();
    return true;
  } catch (const CommunicationError&) {
    throw;
  } catch (const TimeoutError&) {
    throw;
  } catch (const std::exception& e) {
    DTRAIN_LOG(kWarning) << "replica group " << endpoint_.replica_id << " (the lowest of the quorum, which writes "
                         << "the job's checkpoints) could not write checkpoint step " << step
                         << "; training goes on, the previous checkpoints are unchanged, and the next checkpoint "
                            "step writes again (Note [Failed checkpoint writes]): "
                         << e.what();
    return false;
  }
}

bool FaultTolerantStep::writes_checkpoints() const {
  const auto& members = replicas_->quorum().members;
  return !members.empty() && members.front().replica_id == endpoint_.replica_id;
}

}  // namespace detail
}  // namespace dtrain
