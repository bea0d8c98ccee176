// Private to src/comm/: point-to-point send and receive through shared memory
// between ranks of a Gloo group that run on one host. See Note [Shared-memory
// point-to-point] in shm_p2p.cpp; ProcessGroup::isend / irecv (p2p.cpp)
// route CPU tensors here when GroupOptions::intra_host_shared_memory is on.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "dtrain/comm/store.h"

namespace dtrain::dist::detail {

class SharedMemoryP2P {
 public:
  struct Options {
    int rank = 0;
    int size = 1;
    std::chrono::milliseconds timeout{0};           // the group's: a peer that neither sends nor reads fails after it
    Store store{nullptr};                           // this group's point-to-point key space
    std::size_t ring_bytes = std::size_t{4} << 20;  // per direction of a pair that talks, in /dev/shm
  };
  // The backend's operations, for pairs that cannot share memory (another
  // host, no room in /dev/shm).
  using BackendSend = std::function<c10::intrusive_ptr<c10d::Work>(const at::Tensor&, int peer, int tag)>;
  using BackendRecv = std::function<c10::intrusive_ptr<c10d::Work>(at::Tensor&, int peer, int tag)>;

  // Publishes this rank's host, pid and a token naming its rings under
  // `store`. Every rank calls it before the group's check-in, so once the
  // group exists, every rank's entry does (the constructor reads them all).
  static void announce(Store store, int rank);

  SharedMemoryP2P(Options options, BackendSend send, BackendRecv recv);
  ~SharedMemoryP2P();
  SharedMemoryP2P(const SharedMemoryP2P&) = delete;
  SharedMemoryP2P& operator=(const SharedMemoryP2P&) = delete;

  // Contiguous CPU tensors; `peer` is another rank of the group (checked by
  // the caller). Gloo's contract: a send completes once its data is out of
  // the tensor; the n-th receive posted for (peer, tag) gets the n-th
  // message the peer sent with that tag, of the same byte size. Failures
  // (peer exited, timeout, size mismatch) are std::runtime_errors naming the
  // peer; the group turns them into CommunicationErrors.
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int peer, int tag);
  c10::intrusive_ptr<c10d::Work> recv(at::Tensor& tensor, int peer, int tag);

  struct Channel;

 private:
  std::shared_ptr<Channel> channel(int peer);
  Options options_;
  BackendSend backend_send_;
  BackendRecv backend_recv_;
  std::uint64_t host_ = 0;
  struct Peers;
  std::unique_ptr<Peers> peers_;                    // every rank's entry
  std::mutex mutex_;                                // guards channels_ (entries are created once, never moved)
  std::vector<std::shared_ptr<Channel>> channels_;  // receives' Works hold theirs
};

}  // namespace dtrain::dist::detail
