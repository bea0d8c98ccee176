// Process groups: the ranks of a job and the collectives between them.
//
// init_process_group() builds the world group from the environment contract
// (see env.h), from an explicit contract, or from a Store (ranks as threads).
// Before connecting the backend, every rank checks in through the store so
// that bad setups fail fast with a clear error instead of hanging: ranks that
// disagree on the world size, two processes claiming one rank, or ranks that
// never arrive (TimeoutError listing the missing ranks).
//
// Collectives follow c10d's contract: every rank of a group calls the same
// collectives in the same order, and a tensor handed to an asynchronous
// collective is not touched until its Work has been waited on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/env.h"
#include "dtrain/comm/store.h"

namespace dtrain::dist {

enum class BackendKind {
  kAuto,  // nccl when GroupOptions::device is CUDA, else gloo
  kGloo,  // CPU tensors; any TCP network
  kNccl,  // CUDA tensors; needs CUDA at run time
};
std::string to_string(BackendKind kind);
// "auto", "gloo" or "nccl"; ConfigError otherwise.
BackendKind parse_backend(const std::string& name);

enum class ReduceOp { kSum, kProduct, kMin, kMax };

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
};

// A handle on an asynchronous collective.
class Work {
 public:
  Work() = default;
  // Blocks until done; throws CommunicationError (or TimeoutError) naming the operation.
  void wait();
  bool is_completed() const;

  struct Impl;
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  const std::shared_ptr<Impl>& impl() const { return impl_; }

 private:
  std::shared_ptr<Impl> impl_;
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

  void barrier();
  // In-place all-reduce of one tensor.
  Work all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // In-place broadcast from the group rank `root`.
  Work broadcast(at::Tensor& tensor, int root);
  // Blocking all-gather: element r of the result is rank r's `tensor`.
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor);

  // Creates a subgroup of the ranks of this group listed in `ranks` (any
  // order, no duplicates). Collective: every rank of this group must call it with the
  // same list, members and non-members alike, as in torch.distributed.new_group.
  // Members get the subgroup (their rank is their position in the sorted list);
  // non-members get std::nullopt. Mismatched lists are detected and reported.
  std::optional<ProcessGroup> new_group(std::vector<int> ranks);

  // For dtrain's own strategies (src/comm/c10d_access.h).
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
ProcessGroup init_process_group(Store store, int rank, int world_size, const GroupOptions& options = {});

}  // namespace dtrain::dist
