// Communication hooks for DistributedDataParallel: how a gradient bucket is
// reduced across ranks (torch's DistributedDataParallel.register_comm_hook).
//
// DDP hands each bucket to its hook as soon as all the bucket's gradients
// are ready, on the thread running backward, in the same order on every
// rank. The hook starts the reduction and returns a future that completes
// with the reduced flat buffer — by convention the average over the group,
// which DDP writes back into the parameters' gradients when backward ends.
// Communicate only through the ProcessGroup passed in (the one DDP wraps), so
// the transport choice and error reporting are the group's.
//
//   class SumHook : public dtrain::CommHook {   // sums instead of averaging
//    public:
//     dtrain::dist::Future run(dtrain::dist::ProcessGroup& group, dtrain::GradBucket& bucket) override {
//       return group.all_reduce(bucket.buffer).future();
//     }
//   };
//   DDPOptions{.comm_hook = std::make_shared<SumHook>()}
//
// A hook object keeps per-model state (PowerSGD's error feedback): give each
// DistributedDataParallel its own.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain {

struct GradBucket {
  std::size_t index = 0;  // position in communication order (0 holds the last layers)
  bool is_last = false;   // the last bucket of this backward
  // The flat buffer (all the bucket's gradients, concatenated); reduce this.
  at::Tensor buffer;
  // Views into `buffer`, one per parameter, shaped like the parameters.
  std::vector<at::Tensor> gradients;
  std::vector<at::Tensor> parameters;
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // Starts reducing `bucket.buffer` over `group`; the future completes with
  // the reduced buffer (an at::Tensor of buffer's size and dtype), or with
  // the failure. Called on the backward thread; see the contract above.
  virtual dist::Future run(dist::ProcessGroup& group, GradBucket& bucket) = 0;
};

struct PowerSgdOptions {
  int matrix_approximation_rank = 1;
  // Plain all-reduce for this many iterations first (warm-up).
  int start_iteration = 10;
  bool use_error_feedback = true;
  // Reuse the last iteration's Q as the starting point (warm start).
  bool warm_start = true;
  // Tensors whose compression would save less than this factor are all-reduced uncompressed.
  double min_compression_rate = 2.0;
  std::uint64_t seed = 0;
};

// Built-in hooks.
namespace hooks {
// Average through the group (shared memory for CPU ranks on one host, else
// the backend): multiply by 1/size, then sum, the rounding of DDP without a
// hook (which does the multiply in its copy into the bucket).
std::shared_ptr<CommHook> all_reduce();
// Compress to float16 / bfloat16, average, decompress (half the traffic).
std::shared_ptr<CommHook> fp16_compress();
std::shared_ptr<CommHook> bf16_compress();
// Low-rank PowerSGD compression (Vogels et al., 2019), as torch's powerSGD_hook.
std::shared_ptr<CommHook> powersgd(const PowerSgdOptions& options = {});
}  // namespace hooks

}  // namespace dtrain
