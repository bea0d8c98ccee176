// Private to src/comm/: collectives through shared memory for CPU ranks on one
// host. c10d has no such transport for CPU tensors (Gloo goes through TCP on
// loopback). See Note [Shared-memory transport] in shm_transport.cpp; the
// group decides when to use it (Note [Transport choice], collectives.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace dtrain::dist::detail {

// What create() needs from the group, done over its backend (not through the
// transport being made): element r of all_gather_u64's result is rank r's
// value; broadcast_i64 sends rank 0's value; all_min returns the minimum.
struct ShmBootstrap {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::function<std::vector<std::uint64_t>(std::uint64_t)> all_gather_u64;
  std::function<std::int64_t(std::int64_t)> broadcast_i64;
  std::function<std::int64_t(std::int64_t)> all_min;
};

class SharedMemoryTransport {
 public:
  // Collective. Returns nullptr on every rank unless all ranks run on this
  // host (same host name, boot id and pid namespace) and the shared region
  // could be made on all of them.
  static std::unique_ptr<SharedMemoryTransport> create(const ShmBootstrap& bootstrap);
  ~SharedMemoryTransport();

  // Each: every rank calls it with the same sizes and dtype, in the same
  // order (after one fails on any rank, every later one fails: Note [A
  // failed operation]); tensors are contiguous CPU tensors; every rank gets bitwise the
  // same sums (each partition is summed once, in rank order). Throws
  // std::runtime_error naming the peer that died or did not arrive in time
  // (the group turns it into a CommunicationError naming the operation).
  void all_reduce_sum(at::Tensor& tensor);
  // `input` holds size() slices of output.numel() elements; output = sum of slice rank().
  void reduce_scatter_sum(at::Tensor& output, const at::Tensor& input);
  // output (size() * input.numel() elements) = every rank's input in rank order.
  void all_gather(at::Tensor& output, const at::Tensor& input);

  struct Region;

 private:
  SharedMemoryTransport() = default;
  void barrier();
  // The half of every slot the next stripe uses (they alternate; see the Note).
  int next_half();
  // Runs an operation; its failure makes this transport refuse every later
  // one (Note [A failed operation]).
  template <typename F>
  void guarded(const F& operation);
  void all_reduce_sum_unguarded(at::Tensor& tensor);
  void reduce_scatter_sum_unguarded(at::Tensor& output, const at::Tensor& input);
  void all_gather_unguarded(at::Tensor& output, const at::Tensor& input);
  std::unique_ptr<Region> region_;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t phase_ = 0;
  int half_ = 1;
  std::string broken_;  // why an operation failed here; empty while usable
  std::chrono::milliseconds timeout_{0};
  std::chrono::microseconds spin_{1};  // a barrier's spin before it sleeps (Note [Barrier waits])
};

}  // namespace dtrain::dist::detail
