// Private: all-reduce through shared memory for ranks on one host (CPU
// tensors), and the DDP communication hook that uses it. c10d has no such
// transport for CPU tensors: Gloo goes through TCP on loopback. See Note
// [Shared-memory all-reduce] in shm_allreduce.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <chrono>
#include <memory>

#include "dtrain/comm/process_group.h"

namespace dtrain::detail {

class SharedMemoryAllReduce {
 public:
  // Collective over `group`. Returns nullptr on every rank unless all ranks
  // run on this host (same host name and boot id) and the shared region could
  // be made on all of them.
  static std::unique_ptr<SharedMemoryAllReduce> create(dist::ProcessGroup& group, std::chrono::milliseconds timeout);
  ~SharedMemoryAllReduce();

  // Sums `tensor` (contiguous, CPU) over the ranks in place; every rank gets
  // bitwise the same result. Every rank must call it with the same sizes, in
  // the same order. Throws CommunicationError when a peer does not arrive
  // within the timeout.
  void sum(at::Tensor& tensor);

  struct Region;

 private:
  SharedMemoryAllReduce() = default;
  void barrier();
  std::unique_ptr<Region> region_;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t phase_ = 0;
  std::chrono::milliseconds timeout_{0};
};

// The DDP hook: averages each bucket through shared memory, on a worker
// thread (so backward goes on), buckets in the order the Reducer hands them over.
std::unique_ptr<c10d::CommHookInterface> make_shared_memory_hook(std::unique_ptr<SharedMemoryAllReduce> shm,
                                                                int world_size);

}  // namespace dtrain::detail
