// Tensor-parallel linear layers, Megatron-LM's split of y = x W^T + b over
// the mesh's `tp` dimension (t ranks):
//
//   ColumnParallelLinear  W [out, in] Shard(0): rank r holds rows
//                         r*out/t .. (r+1)*out/t and their bias; input
//                         replicated (f: identity forward, all-reduce of the
//                         input gradient backward), output [.., out/t]
//                         (or all-gathered to [.., out] by option).
//   RowParallelLinear     W [out, in] Shard(1): rank r holds columns
//                         r*in/t ..; input [.., in/t] (the column layer's
//                         output), partial outputs summed by one all-reduce
//                         (g); bias replicated, added after the sum.
//
// A column layer followed by a row layer (an MLP, attention by heads)
// communicates once each way: an all-reduce of the output in forward and one
// of the input gradient in backward. With sequence parallelism (Korthikanti
// et al. 2022) the input of the column layer holds 1/t of the sequence and
// is all-gathered (its gradient reduce-scattered), and the row layer's sum
// is a reduce-scatter to 1/t of the sequence (its gradient all-gathered):
// the same bytes, and the regions between hold 1/t of the activations.
//
// Parameters carry their layouts (dist::DeclaresLayouts); copy_from_full()
// loads this rank's part of an unsplit layer's weights. Sizes not divisible
// by the tensor-parallel degree are a ConfigError naming them.
//
// The products go through dtrain::nn::linear (oneDNN on the CPU in fp32).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"

namespace dtrain::nn {

struct ColumnParallelLinearOptions {
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
  bool bias = true;
  // All-gather the output so every rank holds [.., out_features]; false
  // (Megatron's default): rank r keeps its out_features / t columns, the
  // input of a row-parallel layer.
  bool gather_output = false;
  // The input holds this rank's 1/t of the sequence along sequence_dim and
  // is all-gathered before the product (reduce-scatter of its gradient).
  bool sequence_parallel = false;
  std::int64_t sequence_dim = 1;  // [batch, sequence, features]
  // The weight stacks `partitions` matrices of out_features / partitions rows
  // (a fused QKV projection: 3), each split over tp, so rank r's output is
  // its part of each: [q_r, k_r, v_r]. Its layout is then
  // [partitions, out / partitions, in] sharded on dimension 1.
  std::int64_t partitions = 1;
};

class ColumnParallelLinearImpl : public torch::nn::Module, public dist::DeclaresLayouts {
 public:
  // Takes the mesh's tp group; ConfigError for sizes tp does not divide.
  ColumnParallelLinearImpl(dist::DeviceMesh& mesh, const ColumnParallelLinearOptions& options);

  // x: [.., in] (with sequence parallelism: 1/t of the sequence) ->
  // [.., out / t], or [.., out] with gather_output.
  at::Tensor forward(const at::Tensor& x);
  dist::NamedLayouts parameter_layouts() const override;
  // Copies this rank's part of an unsplit layer's weight [out, in] (and bias
  // [out]; undefined when the layer has none). No autograd.
  void copy_from_full(const at::Tensor& weight, const at::Tensor& bias = {});

  const ColumnParallelLinearOptions& options() const { return options_; }
  at::Tensor weight, bias;

 private:
  dist::Layout layout_of(bool is_weight) const;

  ColumnParallelLinearOptions options_;
  dist::ProcessGroup tp_;
  std::vector<dist::MeshDim> mesh_dims_;
  std::vector<int> coordinates_;
};
// TORCH_MODULE's holder, plus a constructor that takes designated
// initialisers (ColumnParallelLinear(mesh, {.in_features = ...})).
class ColumnParallelLinear : public torch::nn::ModuleHolder<ColumnParallelLinearImpl> {
 public:
  using torch::nn::ModuleHolder<ColumnParallelLinearImpl>::ModuleHolder;
  using torch::nn::ModuleHolder<ColumnParallelLinearImpl>::get;
  ColumnParallelLinear(dist::DeviceMesh& mesh, const ColumnParallelLinearOptions& options)
      : ModuleHolder(std::make_shared<ColumnParallelLinearImpl>(mesh, options)) {}
};

struct RowParallelLinearOptions {
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
  bool bias = true;
  // The input is already split along its last dimension (a column-parallel
  // layer's output); false: it is replicated and each rank takes its slice.
  bool input_is_parallel = true;
  // Reduce-scatter the output along sequence_dim (each rank keeps 1/t of the
  // sequence) instead of all-reducing it. The bias is then added to the
  // rank's part and its gradient summed over tp in backward.
  bool sequence_parallel = false;
  std::int64_t sequence_dim = 1;
};

class RowParallelLinearImpl : public torch::nn::Module, public dist::DeclaresLayouts {
 public:
  RowParallelLinearImpl(dist::DeviceMesh& mesh, const RowParallelLinearOptions& options);

  // x: [.., in / t] (or [.., in] when !input_is_parallel) -> [.., out]
  // (with sequence parallelism: 1/t of the sequence).
  at::Tensor forward(const at::Tensor& x);
  dist::NamedLayouts parameter_layouts() const override;
  void copy_from_full(const at::Tensor& weight, const at::Tensor& bias = {});

  const RowParallelLinearOptions& options() const { return options_; }
  at::Tensor weight, bias;

 private:
  RowParallelLinearOptions options_;
  dist::ProcessGroup tp_;
  std::vector<dist::MeshDim> mesh_dims_;
  std::vector<int> coordinates_;
};
// TORCH_MODULE's holder, plus a constructor that takes designated
// initialisers (RowParallelLinear(mesh, {.in_features = ...})).
class RowParallelLinear : public torch::nn::ModuleHolder<RowParallelLinearImpl> {
 public:
  using torch::nn::ModuleHolder<RowParallelLinearImpl>::ModuleHolder;
  using torch::nn::ModuleHolder<RowParallelLinearImpl>::get;
  RowParallelLinear(dist::DeviceMesh& mesh, const RowParallelLinearOptions& options)
      : ModuleHolder(std::make_shared<RowParallelLinearImpl>(mesh, options)) {}
};

namespace detail {
// The placements of a tensor sharded on dimension `dim` over the mesh's tp
// dimension and replicated over the others (dim < 0: replicated everywhere).
std::vector<dist::Placement> tp_placements(const std::vector<dist::MeshDim>& mesh, int dim);
// ConfigError unless `size` (named `what`) is a multiple of `parts`.
void check_tp_divisible(std::int64_t size, std::int64_t parts, const char* layer, const char* what);
}  // namespace detail

}  // namespace dtrain::nn
