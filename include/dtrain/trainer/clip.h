// Gradient clipping by global norm, correct when gradients are spread across
// ranks.
//
//   dtrain::clip_grad_norm_(model->parameters(), 1.0);               // single process, DDP, DataParallel
//   dtrain::ShardedGradients shards(my_params, shard_group);         // each rank holds a different part
//   dtrain::clip_grad_norm_(shards, 1.0);
//
// The norm is the one over all of the model's gradients, ||g||_p =
// (sum |g_i|^p)^(1/p), or max |g_i| for p = inf: each rank computes its partial
// (the sum of p-th powers of its gradients' norms, or their max) and a
// GradientSet says how partials combine. Where every rank holds every
// (identical) gradient, as after DDP's all-reduce, nothing is exchanged: the
// local norm is the global one. Where each rank holds a disjoint part (ZeRO
// shards, pipeline stages), the partials are all-reduced (SUM, or MAX for
// p = inf) over the group holding the parts. Each strategy provides the
// GradientSet matching how it places gradients; the two here cover both cases.
//
// As torch.nn.utils.clip_grad_norm_: every gradient is multiplied by
// min(1, max_norm / (norm + 1e-6)), and the total norm (of the gradients
// before clipping) is returned as a 0-dim tensor, without synchronizing with a
// GPU unless error_if_nonfinite asks for the check.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain {

// How a model's gradients are spread over ranks, for global norms.
class GradientSet {
 public:
  virtual ~GradientSet() = default;
  // The parameters whose gradients this rank holds and counts (each gradient
  // must be counted on exactly one rank of the combining group, or on all when
  // nothing is combined). Parameters without a gradient are skipped.
  virtual std::vector<at::Tensor> local_parameters() const = 0;
  // Turns this rank's partial result into the global one, in place:
  // `partial` (0-dim, fp32 or fp64) is the sum over local gradients of
  // ||g||_p^p, or the max of ||g||_inf when `max` is true. Collective for sharded sets.
  virtual void combine(at::Tensor& partial, bool max) const = 0;
};

// Every rank holds all gradients, identical across ranks (single process, DDP
// after backward, DataParallel): the local norm is the global one.
class ReplicatedGradients : public GradientSet {
 public:
  explicit ReplicatedGradients(std::vector<at::Tensor> parameters) : parameters_(std::move(parameters)) {}
  std::vector<at::Tensor> local_parameters() const override { return parameters_; }
  void combine(at::Tensor& /*partial*/, bool /*max*/) const override {}

 private:
  std::vector<at::Tensor> parameters_;
};

// Each rank of `group` holds a disjoint part of the gradients: partials are
// all-reduced over the group (every rank must call, even one with no gradients).
class ShardedGradients : public GradientSet {
 public:
  ShardedGradients(std::vector<at::Tensor> parameters, dist::ProcessGroup group)
      : parameters_(std::move(parameters)), group_(std::move(group)) {}
  std::vector<at::Tensor> local_parameters() const override { return parameters_; }
  void combine(at::Tensor& partial, bool max) const override;

 private:
  std::vector<at::Tensor> parameters_;
  mutable dist::ProcessGroup group_;
};

struct ClipGradNormOptions {
  double norm_type = 2.0;  // p > 0, or std::numeric_limits<double>::infinity()
  // Throw (on every rank alike) when the total norm is inf or NaN instead of
  // scaling the gradients by a non-finite factor. Synchronizes with the device.
  bool error_if_nonfinite = false;
};

// The global norm of the gradients (0 when there are none), not modifying them.
at::Tensor grad_norm(const GradientSet& gradients, const ClipGradNormOptions& options = {});
// Scales the gradients so that their global norm is at most `max_norm`;
// returns the norm before clipping.
at::Tensor clip_grad_norm_(const GradientSet& gradients, double max_norm, const ClipGradNormOptions& options = {});
// The replicated case.
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           const ClipGradNormOptions& options = {});

}  // namespace dtrain
