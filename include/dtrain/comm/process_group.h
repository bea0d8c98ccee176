// Process groups: the ranks of a job and the one door between them.
//
// init_process_group() builds the world group from the environment contract
// (see env.h), from an explicit contract, or from a Store (ranks as threads).
// Before connecting the backend, every rank checks in through the store so
// that bad setups fail fast with a clear error instead of hanging: ranks that
// disagree on the world size, two processes claiming one rank, or ranks that
// never arrive (TimeoutError listing the missing ranks).
//
// Every collective and point-to-point operation dtrain's strategies use is a
// method here, returning a Work. Contracts (c10d's):
//  - every rank of a group issues the same collectives in the same order;
//  - a tensor handed to an operation is not touched (read or written) until
//    its Work has been waited on;
//  - every failure (a peer gone, a timeout, mismatched sizes) surfaces as a
//    dtrain::CommunicationError naming the operation, the group, this rank,
//    the peer for point-to-point operations, and the sizes involved.
// Where a transport of dtrain's own is measurably better the group uses it
// (see Note [Transport choice] in src/comm/collectives.cpp): CPU ranks on one
// host all-reduce, reduce-scatter and all-gather through shared memory.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/env.h"
#include "dtrain/comm/store.h"

namespace c10::ivalue {
struct Future;
}

namespace dtrain::dist {

enum class BackendKind {
  kAuto,  // nccl when GroupOptions::device is CUDA, else gloo
  kGloo,  // CPU tensors; any TCP network
  kNccl,  // CUDA tensors; needs CUDA at run time
};
std::string to_string(BackendKind kind);
// "auto", "gloo" or "nccl"; ConfigError otherwise.
BackendKind parse_backend(const std::string& name);

enum class ReduceOp {
  kSum,
  kAvg,  // sum divided by the group size (integer tensors: truncating division)
  kProduct,
  kMin,
  kMax,
};
std::string to_string(ReduceOp op);

struct GroupOptions {
  BackendKind backend = BackendKind::kAuto;
  // The device this rank trains on; decides kAuto, and binds NCCL to a GPU.
  c10::Device device = c10::Device(c10::kCPU);
  // Timeout of rendezvous and collectives. Unset: DTRAIN_TIMEOUT_SECONDS, else 30 min.
  std::optional<std::chrono::milliseconds> timeout;
  // Address this rank's Gloo transport binds to. Empty: the interface named by
  // GLOO_SOCKET_IFNAME if set, 127.0.0.1 when MASTER_ADDR is a loopback
  // address, else this host's name (as torch.distributed does).
  std::string gloo_host;
  // Names the group in errors and separates its keys in the store.
  std::string name = "world";
  // When every rank of a Gloo group runs on this host, CPU all_reduce (sum,
  // avg), reduce_scatter and all_gather go through a shared-memory region
  // instead of loopback TCP (set up at the first such call; falls back to
  // Gloo where /dev/shm has no room). Results are bitwise equal on all ranks.
  // Likewise send/recv of CPU tensors between two ranks on one host go
  // through a ring in /dev/shm (4 MiB per direction of a pair that talks,
  // made at its first send), not loopback TCP; pairs on two hosts use Gloo.
  // Both sides of a transfer must pass CPU tensors (or both not).
  bool intra_host_shared_memory = true;
};

// A future of an operation's result: completes with its output tensor (an
// at::Tensor IValue), or with the operation's CommunicationError.
using Future = c10::intrusive_ptr<c10::ivalue::Future>;

// A handle on an asynchronous operation.
class Work {
 public:
  Work() = default;
  // Blocks until done (at most the group's timeout); throws CommunicationError
  // naming the operation, group, rank, peer and sizes. Waiting again is a no-op.
  // May be called from several threads, before or after future(), with a
  // future()'s continuation pending: it ends with the operation either way
  // (Note [Waits and continuations], src/comm/work.cpp).
  void wait();
  // The result as a future, for chaining (e.g. DDP communication hooks).
  // Completes with the output tensor; the caller may not touch it before.
  Future future();

  struct Impl;
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  const std::shared_ptr<Impl>& impl() const { return impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

// One send or receive of a batch (see ProcessGroup::batch_isend_irecv).
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  at::Tensor tensor;
  int peer = 0;  // group rank
  int tag = 0;
};

namespace detail {
struct GroupState;
}

class ProcessGroup {
 public:
  int rank() const;
  int size() const;
  BackendKind backend() const;
  c10::Device device() const;
  std::chrono::milliseconds timeout() const;
  const std::string& name() const;
  // For a subgroup, its members' ranks in the world group (index = group rank).
  const std::vector<int>& world_ranks() const;

  // ---- collectives ----
  void barrier();
  // In place: every rank ends with op over all ranks' `tensor`.
  Work all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // In place, one operation for many tensors (flattened per dtype and device).
  Work all_reduce_coalesced(std::vector<at::Tensor>& tensors, ReduceOp op = ReduceOp::kSum);
  // In place, from the group rank `root`.
  Work broadcast(at::Tensor& tensor, int root);
  Work broadcast_coalesced(std::vector<at::Tensor>& tensors, int root);
  // `output` (size() * input.numel() elements, contiguous, input's dtype)
  // receives every rank's `input`, rank r's at offset r * input.numel().
  Work all_gather_into(at::Tensor& output, const at::Tensor& input);
  // Blocking convenience: element r of the result is rank r's `tensor`.
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor);
  // `input` holds size() equal slices; rank r's `output` gets op over all
  // ranks of slice r. Shapes as in all_gather_into, reversed.
  Work reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::kSum);

  // ---- point to point (peer: a rank of this group, not this rank) ----
  Work isend(const at::Tensor& tensor, int peer, int tag = 0);
  Work irecv(at::Tensor& tensor, int peer, int tag = 0);
  void send(const at::Tensor& tensor, int peer, int tag = 0) { isend(tensor, peer, tag).wait(); }
  void recv(at::Tensor& tensor, int peer, int tag = 0) { irecv(tensor, peer, tag).wait(); }
  // Issues every op of `ops` so that no order of calls across ranks can
  // deadlock (receives are posted before sends; NCCL groups them), and
  // returns one Work per op.
  std::vector<Work> batch_isend_irecv(std::vector<P2POp>& ops);

  // Creates a subgroup of the ranks of this group listed in `ranks` (any
  // order, no duplicates). Collective: every rank of this group must call it with the
  // same list, members and non-members alike, as in torch.distributed.new_group.
  // Members get the subgroup (their rank is their position in the sorted list);
  // non-members get std::nullopt. Mismatched lists are detected and reported.
  std::optional<ProcessGroup> new_group(std::vector<int> ranks);

  // Whether CPU collectives of this group go through shared memory (decided
  // at the first eligible collective; see GroupOptions::intra_host_shared_memory).
  bool uses_shared_memory() const;

  // For src/comm/ only.
  const std::shared_ptr<detail::GroupState>& state() const { return state_; }
  explicit ProcessGroup(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<detail::GroupState> state_;
};

// The world group from the process environment (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, ...). Rank 0 hosts the TCP store on MASTER_PORT.
ProcessGroup init_process_group(const GroupOptions& options = {});
ProcessGroup init_process_group(const EnvContract& contract, const GroupOptions& options = {});
// The world group over an existing store, e.g. Store::in_memory() shared by
// rank threads. The calling thread's log identity becomes this rank.
ProcessGroup init_process_group(const Store& store, int rank, int world_size, const GroupOptions& options = {});

}  // namespace dtrain::dist
