// Column- and row-parallel linear layers (see parallel_linear.h).
#include "dtrain/nn/parallel_linear.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

#include "dtrain/error.h"
#include "dtrain/nn/linear.h"
#include "dtrain/nn/tp_comm.h"

namespace dtrain::nn {

namespace detail {

std::vector<dist::Placement> tp_placements(const std::vector<dist::MeshDim>& mesh, int dim) {
  std::vector<dist::Placement> placements(mesh.size(), dist::Placement::replicate());
  for (std::size_t d = 0; d < mesh.size(); ++d)
    if (mesh[d].name == "tp" && dim >= 0) placements[d] = dist::Placement::shard(dim);
  return placements;
}

void check_tp_divisible(std::int64_t size, std::int64_t parts, const char* layer, const char* what) {
  DTRAIN_CHECK(size > 0 && size % parts == 0, ConfigError,
               layer << ": " << what << " " << size << " is not divisible by the tensor-parallel degree " << parts
                     << " (each rank holds an equal part).",
               "make " << what << " a multiple of " << parts << ", or use another tp degree");
}

}  // namespace detail

namespace {

// Uniform(-1/sqrt(in), 1/sqrt(in)), torch::nn::Linear's default range, drawn
// per rank for its own part; copy_from_full() gives an unsplit layer's values.
at::Tensor init_uniform(std::vector<std::int64_t> sizes, std::int64_t fan_in) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return at::empty(sizes).uniform_(-bound, bound);
}

// Copies this rank's part of `full` (shaped `full_shape`, the unsplit
// layer's; the layout may view it otherwise, e.g. [3, C, C] for [3C, C]).
void copy_part(at::Tensor& local, const at::Tensor& full, const std::vector<std::int64_t>& full_shape,
               const dist::Layout& layout, const std::vector<int>& coordinates, const char* what) {
  DTRAIN_CHECK(full.sizes().vec() == full_shape, ConfigError,
               "copy_from_full: the full " << what << " has shape " << full.sizes() << ", the unsplit layer's is "
                                           << at::IntArrayRef(full_shape),
               "pass the unsplit layer's " << what);
  c10::NoGradGuard no_grad;
  local.copy_(dist::local_part(full.reshape(layout.global_shape), layout, coordinates).reshape(local.sizes()));
}

}  // namespace

// ---- ColumnParallelLinear ----

ColumnParallelLinearImpl::ColumnParallelLinearImpl(dist::DeviceMesh& mesh, const ColumnParallelLinearOptions& options)
    : options_(options), tp_(mesh["tp"]), mesh_dims_(mesh.dims()), coordinates_(mesh.coordinates()) {
  const std::int64_t t = tp_.size();
  DTRAIN_CHECK(options_.in_features > 0 && options_.partitions >= 1, ConfigError,
               "ColumnParallelLinear: in_features " << options_.in_features << ", partitions " << options_.partitions,
               "in_features and partitions are at least 1");
  DTRAIN_CHECK(!(options_.gather_output && options_.partitions > 1), ConfigError,
               "ColumnParallelLinear: gather_output with " << options_.partitions
                                                           << " partitions would interleave the partitions by rank.",
               "keep the output split (a row-parallel layer or per-head attention next)");
  detail::check_tp_divisible(options_.out_features, t * options_.partitions, "ColumnParallelLinear",
                             options_.partitions > 1 ? "out_features (over partitions x tp)" : "out_features");
  const std::int64_t local_out = options_.out_features / t;
  weight = register_parameter("weight", init_uniform({local_out, options_.in_features}, options_.in_features));
  if (options_.bias) bias = register_parameter("bias", init_uniform({local_out}, options_.in_features));
}

dist::Layout ColumnParallelLinearImpl::layout_of(bool is_weight) const {
  const std::int64_t p = options_.partitions, out = options_.out_features, in = options_.in_features;
  std::vector<std::int64_t> shape = p == 1 ? std::vector<std::int64_t>{out} : std::vector<std::int64_t>{p, out / p};
  if (is_weight) shape.push_back(in);
  return {.mesh = mesh_dims_,
          .placements = detail::tp_placements(mesh_dims_, p == 1 ? 0 : 1),
          .global_shape = std::move(shape)};
}

dist::NamedLayouts ColumnParallelLinearImpl::parameter_layouts() const {
  dist::NamedLayouts out{{"weight", layout_of(true)}};
  if (bias.defined()) out.emplace_back("bias", layout_of(false));
  return out;
}

void ColumnParallelLinearImpl::copy_from_full(const at::Tensor& full_weight, const at::Tensor& full_bias) {
  const std::int64_t out = options_.out_features, in = options_.in_features;
  copy_part(weight, full_weight, {out, in}, layout_of(true), coordinates_, "weight");
  DTRAIN_CHECK(full_bias.defined() == bias.defined(), ConfigError,
               "copy_from_full: the layer " << (bias.defined() ? "has" : "has no") << " bias, the full one "
                                            << (full_bias.defined() ? "has" : "has not"),
               "pass a bias exactly when the layer has one");
  if (bias.defined()) copy_part(bias, full_bias, {out}, layout_of(false), coordinates_, "bias");
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y;
  if (options_.sequence_parallel && tp_.size() > 1) {
    // Keeps 1/t of the input for backward (see gathered_linear).
    y = tp::gathered_linear(x, weight, tp_, options_.sequence_dim);
    if (bias.defined()) y = y + bias.to(y.scalar_type());
  } else {
    y = nn::linear(tp::copy_to_region(x, tp_), weight, bias);
  }
  return options_.gather_output ? tp::gather_from_region(y, tp_, -1) : y;
}

// ---- RowParallelLinear ----

RowParallelLinearImpl::RowParallelLinearImpl(dist::DeviceMesh& mesh, const RowParallelLinearOptions& options)
    : options_(options), tp_(mesh["tp"]), mesh_dims_(mesh.dims()), coordinates_(mesh.coordinates()) {
  const std::int64_t t = tp_.size();
  DTRAIN_CHECK(options_.out_features > 0, ConfigError, "RowParallelLinear: out_features " << options_.out_features,
               "out_features is at least 1");
  detail::check_tp_divisible(options_.in_features, t, "RowParallelLinear", "in_features");
  weight = register_parameter("weight",
                              init_uniform({options_.out_features, options_.in_features / t}, options_.in_features));
  if (options_.bias) bias = register_parameter("bias", init_uniform({options_.out_features}, options_.in_features));
}

dist::NamedLayouts RowParallelLinearImpl::parameter_layouts() const {
  dist::NamedLayouts out{{"weight",
                          {.mesh = mesh_dims_,
                           .placements = detail::tp_placements(mesh_dims_, 1),
                           .global_shape = {options_.out_features, options_.in_features}}}};
  if (bias.defined())
    out.emplace_back("bias", dist::Layout{.mesh = mesh_dims_,
                                          .placements = detail::tp_placements(mesh_dims_, -1),
                                          .global_shape = {options_.out_features}});
  return out;
}

void RowParallelLinearImpl::copy_from_full(const at::Tensor& full_weight, const at::Tensor& full_bias) {
  const dist::NamedLayouts layouts = parameter_layouts();
  copy_part(weight, full_weight, layouts[0].second.global_shape, layouts[0].second, coordinates_, "weight");
  DTRAIN_CHECK(full_bias.defined() == bias.defined(), ConfigError,
               "copy_from_full: the layer " << (bias.defined() ? "has" : "has no") << " bias, the full one "
                                            << (full_bias.defined() ? "has" : "has not"),
               "pass a bias exactly when the layer has one");
  if (bias.defined())
    copy_part(bias, full_bias, layouts[1].second.global_shape, layouts[1].second, coordinates_, "bias");
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor input = options_.input_is_parallel ? x : tp::scatter_to_region(x, tp_, -1);
  const at::Tensor partial = nn::linear(input, weight);
  if (!options_.sequence_parallel) {
    const at::Tensor y = tp::reduce_from_region(partial, tp_);
    // In the output's dtype: under autocast the product is bf16 and
    // at::linear would have added a bf16 bias.
    return bias.defined() ? y + bias.to(y.scalar_type()) : y;
  }
  const at::Tensor y = tp::reduce_scatter_to_sequence(partial, tp_, options_.sequence_dim);
  // Each rank adds the bias to its part of the sequence, so its gradient is
  // a partial sum: f sums it over tp in backward (Megatron all-reduces such
  // "sequence-parallel" parameters' gradients after backward instead).
  return bias.defined() ? y + tp::copy_to_region(bias, tp_).to(y.scalar_type()) : y;
}

}  // namespace dtrain::nn
