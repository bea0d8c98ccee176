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
#include "fault_tolerant_step.h"

#include <ATen/core/ivalue.h>
#include <torch/serialize/archive.h>

#include "dtrain/amp/grad_scaler.h"
#include "dtrain/error.h"

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

}  // namespace

ft::ReplicaState Strategy::replica_state(torch::optim::Optimizer& optimizer, ft::ReplicaState extra) {
  return ft::module_and_optimizer_state(module(), optimizer, std::move(extra));
}

namespace detail {

FaultTolerantStep::FaultTolerantStep(const TrainerFaultTolerance& options, Strategy& strategy,
                                     torch::optim::Optimizer& optimizer, amp::GradScaler* scaler,
                                     std::shared_ptr<ScheduledLR> schedule, std::int64_t max_steps)
    : options_(options),
      strategy_(strategy),
      endpoint_(options.lighthouse ? *options.lighthouse : ft::lighthouse_from_env()) {
  auto client_options = options_.client;
  client_options.replica_id = endpoint_.replica_id;
  client_ =
      std::make_unique<ft::LighthouseClient>(ft::connect_lighthouse(endpoint_.host, endpoint_.port),
                                             ft::connect_lighthouse(endpoint_.host, endpoint_.port), client_options);
  std::optional<dist::ProcessGroup> group = strategy_.group();
  if (group && group->size() == 1) group.reset();
  replicas_ = std::make_unique<ft::FaultTolerantReplicas>(
      *client_, strategy_.replica_state(optimizer, trainer_extra_state(scaler, std::move(schedule))),
      ft::FaultTolerantOptions{
          .replica_group = group, .group_timeout = options_.group_timeout, .max_steps = max_steps});
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
  std::vector<at::Tensor> grads;
  for (const auto& p : strategy_.gradients().parameters) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  replicas_->all_reduce_gradients(grads);
  if (!replicas_->should_commit()) return false;
  if (options_.on_commit) options_.on_commit(step, replicas_->quorum());
  return true;
}

bool FaultTolerantStep::writes_checkpoints() const {
  const auto& members = replicas_->quorum().members;
  return !members.empty() && members.front().replica_id == endpoint_.replica_id;
}

}  // namespace detail
}  // namespace dtrain
