// How a module's parameters carry their layouts: a module whose parameters
// are not all replicated (a tensor-parallel layer) implements
// DeclaresLayouts; named_layouts() walks any module tree and gives every
// parameter, by its named_parameters() name, the layout its owning module
// declared, or Replicate over the mesh. Gradient sync, clipping and
// checkpoints read layouts from here, never from per-strategy special cases.
//
//   for (auto& [name, layout] : dist::named_layouts(*model, mesh)) ...
//
// A layout's global shape may be a view of the parameter's (a fused QKV
// weight [3C, C] is laid out as [3, C, C] sharded on dimension 1, so each
// rank holds its heads of q, k and v); the local box always has the
// parameter's number of elements, which named_layouts() checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

#include "dtrain/dist/layout.h"

namespace dtrain::dist {

using NamedLayouts = std::vector<std::pair<std::string, Layout>>;

class DeclaresLayouts {
 public:
  virtual ~DeclaresLayouts() = default;
  // Layouts of this module's own parameters (not its submodules'), by their
  // names in this module; parameters left out are replicated.
  virtual NamedLayouts parameter_layouts() const = 0;
};

// Every parameter of `module` (named_parameters order and names) with its
// layout over `mesh`. ConfigError when a declared layout's local part at
// this rank's coordinates does not have the parameter's number of elements.
NamedLayouts named_layouts(const torch::nn::Module& module, const DeviceMesh& mesh);

// The part of a global tensor (shaped as layout.global_shape) that the rank
// at `coordinates` holds, as a view of `global`.
at::Tensor local_part(const at::Tensor& global, const Layout& layout, const std::vector<int>& coordinates);

}  // namespace dtrain::dist
