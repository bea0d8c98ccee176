// Global-norm gradient clipping over a GradientSet (see include/dtrain/dist/clip.h).
#include "dtrain/dist/clip.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "dtrain/error.h"

namespace dtrain {

namespace {

bool is_inf_norm(double p) {
  return p == std::numeric_limits<double>::infinity();
}

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& parameters) {
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters) {
    // Empty gradients add nothing (and have no max).
    if (p.grad().defined() && p.grad().numel() > 0) grads.push_back(p.grad());
  }
  return grads;
}

// The global norm of `grads` (this rank's part of `gradients`).
at::Tensor total_norm(const GradientSet& gradients, const std::vector<at::Tensor>& grads, double p) {
  DTRAIN_CHECK(is_inf_norm(p) || (std::isfinite(p) && p > 0), ConfigError,
               "gradient norm of order " << p << " is not supported",
               "use norm_type 2 (the usual), any p > 0, or std::numeric_limits<double>::infinity() (max norm)");
  // Norms in fp32 at least (bf16/fp16 gradients would lose the sum), fp64
  // when any parameter is fp64. Read from the parameters, not the gradients:
  // a rank whose parameters got no gradient this step still has the
  // parameters. Partials are combined in fp64 whatever each rank's dtype
  // (a rank with no parameters at all would otherwise send fp32 to peers'
  // fp64), and the sum is returned in this rank's dtype.
  c10::ScalarType acc = at::kFloat;
  for (const auto& param : gradients.parameters) {
    if (param.scalar_type() == at::kDouble) acc = at::kDouble;
  }
  for (const auto& g : grads) {
    if (g.scalar_type() == at::kDouble) acc = at::kDouble;
  }
  at::Tensor partial;
  if (grads.empty()) {
    partial = at::zeros({}, at::TensorOptions().dtype(acc));
  } else {
    const c10::Device device = grads.front().device();
    std::vector<at::Tensor> norms;
    norms.reserve(grads.size());
    for (const auto& g : grads) {
      const at::Tensor values = g.is_sparse() ? g._values() : g;
      norms.push_back(at::linalg_vector_norm(values, p, std::nullopt, false, acc).to(device));
    }
    const at::Tensor stacked = at::stack(norms);
    partial = is_inf_norm(p) ? stacked.max() : stacked.pow(p).sum();
  }
  for (dist::ProcessGroup group : gradients.combine_over) {  // a handle: the copy is the same group
    at::Tensor on_group_device = partial.to(group.device(), at::kDouble);
    group.all_reduce(on_group_device, is_inf_norm(p) ? dist::ReduceOp::kMax : dist::ReduceOp::kSum).wait();
    partial = on_group_device.to(partial.device(), acc);
  }
  return is_inf_norm(p) ? partial : partial.pow(1.0 / p);
}

}  // namespace

GradientSet GradientSet::from_layouts(const std::vector<std::pair<at::Tensor, dist::Layout>>& parameters,
                                      dist::DeviceMesh& mesh, const std::vector<std::string>& partitioned) {
  const std::vector<dist::MeshDim>& dims = mesh.dims();
  for (const std::string& name : partitioned) {
    DTRAIN_CHECK(mesh.has(name), ConfigError,
                 "gradients partitioned over '" << name << "', which the mesh " << mesh.describe() << " lacks",
                 "name a dimension of the mesh the parameters were split over (e.g. pp)");
  }
  // The combining dimensions: partitioned ones and those sharding some parameter.
  std::vector<bool> combines(dims.size(), false);
  for (std::size_t d = 0; d < dims.size(); ++d) {
    combines[d] = std::find(partitioned.begin(), partitioned.end(), dims[d].name) != partitioned.end();
  }
  for (const auto& [parameter, layout] : parameters) {
    DTRAIN_CHECK(layout.mesh == dims, ConfigError,
                 "a parameter's layout " << layout.to_string() << " is over another mesh than " << mesh.describe(),
                 "take layouts from dist::named_layouts(module, mesh) with the mesh the gradients are reduced on");
    for (std::size_t d = 0; d < dims.size(); ++d) {
      const dist::Placement& placement = layout.placements[d];
      DTRAIN_CHECK(placement.kind != dist::Placement::Kind::kPartial, ConfigError,
                   "a gradient laid out as " << layout.to_string()
                                             << " is Partial (not yet reduced), so it has no norm of its own",
                   "take the norm after gradient synchronisation (the Trainer does)");
      if (placement.kind == dist::Placement::Kind::kShard && dims[d].size > 1) combines[d] = true;
    }
  }
  GradientSet set;
  for (std::size_t d = 0; d < dims.size(); ++d) {
    if (combines[d] && dims[d].size > 1) set.combine_over.push_back(mesh[dims[d].name]);
  }
  const std::vector<int>& at = mesh.coordinates();
  for (const auto& [parameter, layout] : parameters) {
    bool counted = true;
    for (std::size_t d = 0; d < dims.size() && counted; ++d) {
      const bool replicated_here = layout.placements[d].kind == dist::Placement::Kind::kReplicate &&
                                   std::find(partitioned.begin(), partitioned.end(), dims[d].name) == partitioned.end();
      if (combines[d] && replicated_here && at[d] != 0) counted = false;
    }
    (counted ? set.parameters : set.counted_elsewhere).push_back(parameter);
  }
  return set;
}

at::Tensor grad_norm(const GradientSet& gradients, const ClipGradNormOptions& options) {
  at::NoGradGuard no_grad;
  return total_norm(gradients, grads_of(gradients.parameters), options.norm_type);
}

at::Tensor clip_grad_norm_(const GradientSet& gradients, double max_norm, const ClipGradNormOptions& options) {
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> grads = grads_of(gradients.parameters);
  at::Tensor norm = total_norm(gradients, grads, options.norm_type);  // not const: returned by move
  if (options.error_if_nonfinite) {
    const double value = norm.item<double>();
    DTRAIN_CHECK(std::isfinite(value), Error,
                 "the total norm of order " << options.norm_type << " of the gradients is " << value
                                            << ", so they cannot be clipped",
                 "look for the inf/NaN source (a GradScaler skips such steps: unscale_ before clipping), or pass "
                 "error_if_nonfinite = false to scale by the non-finite factor anyway");
  }
  // Multiplying by a clamped coefficient (1 when within bounds) instead of
  // testing the norm avoids a device synchronization, as torch does. The
  // coefficient is max_norm / (norm + 1e-6), spelled as ATen's operator/ does.
  const at::Tensor coef = at::clamp(norm.add(1e-6).reciprocal().mul(max_norm), std::nullopt, 1.0);
  for (const std::vector<at::Tensor>& held : {grads, grads_of(gradients.counted_elsewhere)}) {
    for (const auto& g : held) {
      at::Tensor values = g.is_sparse() ? g._values() : g;
      values.mul_(coef.to(values.device()));
    }
  }
  return norm;
}

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           const ClipGradNormOptions& options) {
  return clip_grad_norm_(GradientSet::replicated(parameters), max_norm, options);
}

}  // namespace dtrain
