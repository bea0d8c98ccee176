// ProcessGroup's point-to-point operations. Gloo's send and recv are
// asynchronous (a send completes once the peer's transport has the data, a
// receive once it arrived), so posting every receive of a batch before its
// sends lets any pattern complete; NCCL needs a batch inside one
// coalescing window (ncclGroupStart/End), which the backend opens for us.
#include <ATen/core/ivalue.h>

#include <functional>

#include "dtrain/error.h"
#include "flight_recorder.h"
#include "group_state.h"
#include "shm_p2p.h"

namespace dtrain::dist {
namespace {

detail::OpInfo p2p_info(const char* op, const at::Tensor& tensor, int peer, int tag) {
  return {.op = std::string(op) + (tag != 0 ? "(tag " + std::to_string(tag) + ")" : ""),
          .peer = peer,
          .sizes = detail::describe_tensor(tensor)};
}

void check_p2p(const detail::GroupState& s, const detail::OpInfo& info, const at::Tensor& tensor, int peer) {
  DTRAIN_CHECK(
      peer >= 0 && peer < s.size && peer != s.rank, ConfigError,
      info.op << " to/from rank " << peer << " on " << detail::describe(s) << ": not another rank of the group.",
      "pass a peer in 0.." << s.size - 1 << " other than " << s.rank);
  if (!tensor.defined() || !tensor.is_contiguous()) {
    std::rethrow_exception(detail::communication_error(s, info, "the tensor must be defined and contiguous",
                                                       "pass a contiguous tensor (.contiguous())"));
  }
}

// Dense CPU tensors of a group with a shared-memory channel go through it
// (Note [Shared-memory point-to-point], shm_p2p.cpp); the two sides of a
// transfer must agree, which they do when both tensors are on the CPU.
bool use_shared_memory(const detail::GroupState& s, const at::Tensor& tensor) {
  return s.p2p != nullptr && tensor.is_cpu() && !tensor.is_sparse();
}

// Gloo's send and recv move bytes with writev/readv straight from the
// tensor's pointer, so they take CPU tensors only: a CUDA pointer fails with
// EFAULT ("writev: Bad address", seen on an H100 with two ranks sharing the
// GPU). Its collectives stage device tensors themselves; point-to-point is
// staged here the same way: a send copies to the CPU first, a receive lands
// in a CPU buffer that is copied to the device when its Work completes. Both
// sides then move CPU tensors, so they agree on the shared-memory channel.
bool needs_host_staging(const detail::GroupState& s, const at::Tensor& tensor) {
  return s.kind == BackendKind::kGloo && !tensor.is_cpu();
}

}  // namespace

Work ProcessGroup::isend(const at::Tensor& tensor, int peer, int tag) {
  auto info = p2p_info("send", tensor, peer, tag);
  check_p2p(*state_, info, tensor, peer);
  detail::note_issue(*state_, info, OpKind::kSend, tensor, static_cast<std::int64_t>(tensor.nbytes()));
  const at::Tensor wire = needs_host_staging(*state_, tensor) ? tensor.to(at::kCPU) : tensor;
  std::vector<at::Tensor> tensors{wire};
  return detail::make_work(state_, std::move(info), c10::IValue(tensor), [&] {
    return use_shared_memory(*state_, wire) ? state_->p2p->send(wire, peer, tag)
                                            : state_->backend->send(tensors, peer, tag);
  });
}

Work ProcessGroup::irecv(at::Tensor& tensor, int peer, int tag) {
  auto info = p2p_info("recv", tensor, peer, tag);
  check_p2p(*state_, info, tensor, peer);
  detail::note_issue(*state_, info, OpKind::kRecv, tensor, static_cast<std::int64_t>(tensor.nbytes()));
  const bool staged = needs_host_staging(*state_, tensor);
  at::Tensor wire = staged ? at::empty(tensor.sizes(), tensor.options().device(at::kCPU)) : tensor;
  std::vector<at::Tensor> tensors{wire};
  std::function<void()> finish;
  if (staged) finish = [wire, target = tensor]() mutable { target.copy_(wire); };
  return detail::make_work(
      state_, std::move(info), c10::IValue(tensor),
      [&] {
        return use_shared_memory(*state_, wire) ? state_->p2p->recv(wire, peer, tag)
                                                : state_->backend->recv(tensors, peer, tag);
      },
      std::move(finish));
}

std::vector<Work> ProcessGroup::batch_isend_irecv(std::vector<P2POp>& ops) {
  std::vector<Work> works(ops.size());
  const bool window = state_->kind == BackendKind::kNccl;
  if (window) state_->backend->startCoalescing();
  try {
    for (const bool receives : {true, false}) {
      for (std::size_t i = 0; i < ops.size(); ++i) {
        P2POp& op = ops[i];
        if ((op.kind == P2POp::Kind::kRecv) != receives) continue;
        works[i] = receives ? irecv(op.tensor, op.peer, op.tag) : isend(op.tensor, op.peer, op.tag);
      }
    }
  } catch (...) {
    if (window) state_->backend->endCoalescing();
    throw;
  }
  if (!window) return works;
  // Inside NCCL's window the operations complete together: each op's Work
  // waits on the window's.
  auto end = state_->backend->endCoalescing();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    works[i] =
        detail::make_work(state_, works[i].impl()->outcome->info, c10::IValue(ops[i].tensor), [&] { return end; });
  }
  return works;
}

}  // namespace dtrain::dist
