// Gradient clipping by global norm, correct when gradients are spread across
// ranks.
//
//   dtrain::clip_grad_norm_(model->parameters(), 1.0);                       // single process, DDP, DataParallel
//   dtrain::clip_grad_norm_(dtrain::GradientSet::sharded(mine, group), 1.0); // each rank holds a different part
//   auto set = dtrain::GradientSet::from_layouts(params_with_layouts, mesh); // any plan, read from layouts
//
// The norm is the one over all of the model's gradients, ||g||_p =
// (sum |g_i|^p)^(1/p), or max |g_i| for p = inf: each rank computes its partial
// (the sum of p-th powers of its gradients' norms, or their max) over the
// gradients it counts, and the partials are all-reduced (SUM, or MAX for
// p = inf) over the groups that hold disjoint parts. A GradientSet is that
// description, as data: which parameters this rank counts, and over which
// groups partials combine. Where every rank holds every (identical) gradient,
// as after DDP's all-reduce, nothing is exchanged. Every strategy describes
// its gradients through from_layouts() (the parameters' dist::Layouts over the
// mesh) or, for flat shards that have no mesh, sharded().
//
// As torch.nn.utils.clip_grad_norm_: every gradient is multiplied by
// min(1, max_norm / (norm + 1e-6)), and the total norm (of the gradients
// before clipping) is returned as a 0-dim tensor, without synchronizing with a
// GPU unless error_if_nonfinite asks for the check.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/layout.h"

namespace dtrain {

// How a model's gradients are spread over ranks, for global norms.
struct GradientSet {
  // The parameters whose gradients this rank counts. Each gradient element
  // must be counted on exactly one rank of the combining groups together (on
  // every rank when there are none). Parameters without a gradient are skipped.
  std::vector<at::Tensor> parameters;
  // The groups over which partial results are all-reduced, one after the
  // other (a sum over nested groups is the sum over their product). Every
  // member of each must take part, with or without gradients. Empty: the
  // local norm is the global one.
  std::vector<dist::ProcessGroup> combine_over;
  // This rank's copies of parameters that another rank counts (replicated on
  // a combining dimension, e.g. a LayerNorm's weight on tp ranks above 0):
  // not in the norm, but clipping scales their gradients by the same factor,
  // so the copies stay equal and equal the one-process run.
  std::vector<at::Tensor> counted_elsewhere;

  // Every rank holds all gradients, identical across ranks (single process,
  // DDP after backward, DataParallel).
  static GradientSet replicated(std::vector<at::Tensor> parameters) { return {std::move(parameters), {}}; }
  // Each rank of `group` holds a disjoint part (ZeRO's flat shards).
  static GradientSet sharded(std::vector<at::Tensor> parameters, dist::ProcessGroup group) {
    return {std::move(parameters), {std::move(group)}};
  }
  // From the parameters' layouts over `mesh` (dist::named_layouts). The
  // partials combine over every mesh dimension (of size 2+) on which some
  // parameter is sharded, and over the `partitioned` dimensions: those over
  // which ranks hold disjoint sets of parameters rather than parts of one
  // (`pp`: each stage its own layers). A parameter replicated on a combining
  // dimension is counted only where this rank's coordinate there is 0, so
  // every element is counted once (elsewhere it is in counted_elsewhere,
  // clipped but not counted). Contract: every rank passes layouts that
  // shard the same mesh dimensions (true when every rank builds the same
  // model, or its stage of it, with the same plan), since the combining
  // groups must agree. ConfigError for a Partial placement (a gradient not yet
  // reduced has no norm) or a layout over another mesh.
  static GradientSet from_layouts(const std::vector<std::pair<at::Tensor, dist::Layout>>& parameters,
                                  dist::DeviceMesh& mesh, const std::vector<std::string>& partitioned = {});
};

struct ClipGradNormOptions {
  double norm_type = 2.0;  // p > 0, or std::numeric_limits<double>::infinity()
  // Throw (on every rank alike) when the total norm is inf or NaN instead of
  // scaling the gradients by a non-finite factor. Synchronizes with the device.
  bool error_if_nonfinite = false;
};

// The global norm of the gradients (0 when there are none), not modifying them.
at::Tensor grad_norm(const GradientSet& gradients, const ClipGradNormOptions& options = {});
// Scales the gradients (counted_elsewhere too) so that their global norm is
// at most `max_norm`; returns the norm before clipping.
at::Tensor clip_grad_norm_(const GradientSet& gradients, double max_norm, const ClipGradNormOptions& options = {});
// The replicated case.
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           const ClipGradNormOptions& options = {});

}  // namespace dtrain
