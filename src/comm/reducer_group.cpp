// A c10d Backend that forwards the few operations c10d's Reducer issues
// (all-reduce of the used-parameter map, broadcast of bucket indices, and
// anything a c10d built-in might send) to dtrain's ProcessGroup, so they take
// its transport and fail as CommunicationError like every other operation.
#include "reducer_group.h"

#include <ATen/core/ivalue.h>

#include "group_state.h"

namespace dtrain::dist::detail {
namespace {

// A c10d Work over a dtrain Work.
class ForwardedWork : public c10d::Work {
 public:
  ForwardedWork(dist::Work work, std::vector<at::Tensor> outputs)
      : work_(std::move(work)), outputs_(std::move(outputs)) {}
  bool isCompleted() override { return work_.future()->completed(); }
  bool wait(std::chrono::milliseconds /*timeout: the group's*/) override {
    work_.wait();
    return true;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Completes with the outputs, or with the operation's error: c10's then()
  // runs the continuation whatever the parent's outcome, so it rethrows
  // (the Reducer reads its bucket all-reduces' results through this future).
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto outputs = outputs_;
    return work_.future()->then(
        [outputs](c10::ivalue::Future& done) {
          if (done.hasError()) std::rethrow_exception(done.exception_ptr());
          return c10::IValue(outputs);
        },
        c10::ListType::ofTensors());
  }

 private:
  dist::Work work_;
  std::vector<at::Tensor> outputs_;
};

ReduceOp from_c10d(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::kProduct;
    case c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case c10d::ReduceOp::MAX: return ReduceOp::kMax;
    default: break;
  }
  TORCH_CHECK(false, "dtrain: reduce op ", static_cast<int>(op.op_), " is not supported");
}

class ForwardingBackend : public c10d::Backend {
 public:
  explicit ForwardingBackend(ProcessGroup group)
      : c10d::Backend(group.rank(), group.size()), group_(std::move(group)) {}

  // Not the inner backend's name (see process_group_for_reducer).
  const std::string getBackendName() const override { return "dtrain"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    TORCH_CHECK(tensors.size() == 1, "dtrain: all_reduce of ", tensors.size(), " tensors at once");
    return c10::make_intrusive<ForwardedWork>(group_.all_reduce(tensors[0], from_c10d(opts.reduceOp)), tensors);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    TORCH_CHECK(tensors.size() == 1, "dtrain: broadcast of ", tensors.size(), " tensors at once");
    return c10::make_intrusive<ForwardedWork>(group_.broadcast(tensors[0], static_cast<int>(opts.rootRank)), tensors);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    group_.barrier();
    return c10::make_intrusive<ForwardedWork>(dist::Work(), std::vector<at::Tensor>{});
  }

 private:
  ProcessGroup group_;
};

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> process_group_for_reducer(const ProcessGroup& group) {
  // Not cached in the group's state: the backend holds the state, and the
  // state holding the c10d group would make a cycle that never frees either.
  const GroupState& s = *group.state();
  auto backend = c10::make_intrusive<ForwardingBackend>(group);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(dist::c10d_store(s.store), s.rank, s.size);
  // CUSTOM, not GLOO or NCCL: c10d code (the Reducer's logger) that sees
  // those names casts the backend to ProcessGroupGloo/NCCL.
  const auto type = c10d::ProcessGroup::BackendType::CUSTOM;
  pg->setBackend(c10::DeviceType::CPU, type, backend);
  pg->setBackend(c10::DeviceType::CUDA, type, backend);
  pg->setDefaultBackend(type);
  return pg;
}

}  // namespace dtrain::dist::detail
