// Private to parallelize: parameters a rank holds only to read the whole
// model through full_weights() (a pipeline rank's other stages, tp's full
// copy beside its split) are released while it trains and rematerialised
// for full_weights()'s scope only. Without this every pipeline rank held
// the whole model's weights and every tp rank a full copy beside its part
// (the planner's predicted peaks, docs/planner.md, count neither).
//
// A released parameter keeps its Parameter object, so its name in the
// module, its identity (TensorImpl: PipelineStrategy::name_parameters and
// tied parameters refer to it) and its dtype and device; only its storage
// goes (set_data to an empty tensor). Rematerialised, it has its shape back
// with zeros: the caller writes the current weights into it (gather_layers,
// assemble_by_layouts).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <unordered_set>
#include <vector>

#include "dtrain/trainer/strategy.h"

namespace dtrain::detail {

class ReleasedParameters : public std::enable_shared_from_this<ReleasedParameters> {
 public:
  // Releases every parameter of `module` whose TensorImpl is not in `keep`
  // (parameters shared by several modules are released once).
  static std::shared_ptr<ReleasedParameters> release(const torch::nn::Module& module,
                                                     const std::unordered_set<const void*>& keep);

  // The parameters get their shapes back (zeros) until the returned scope
  // ends; then they are released again, and `inner` (e.g. the strategy's
  // full_parameters() scope) ends after that. Not reentrant: one scope at a
  // time.
  std::unique_ptr<Strategy::Scope> rematerialize(std::unique_ptr<Strategy::Scope> inner = nullptr);

  // Bytes the released parameters take when rematerialised.
  std::int64_t bytes() const;
  std::size_t size() const { return released_.size(); }

 private:
  struct Released {
    at::Tensor parameter;
    std::vector<std::int64_t> shape;
  };
  void release_all();
  std::vector<Released> released_;
  bool materialized_ = false;
};

// The TensorImpls of `tensors` (the `keep` argument above).
std::unordered_set<const void*> identities(const std::vector<at::Tensor>& tensors);

}  // namespace dtrain::detail
