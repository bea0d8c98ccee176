// Parameters released while a rank trains, rematerialised for full_weights()
// (released_parameters.h).
#include "released_parameters.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "dtrain/error.h"

namespace dtrain::detail {

std::shared_ptr<ReleasedParameters> ReleasedParameters::release(const torch::nn::Module& module,
                                                                const std::unordered_set<const void*>& keep) {
  auto out = std::make_shared<ReleasedParameters>();
  std::unordered_set<const void*> seen = keep;
  for (const at::Tensor& p : module.parameters()) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    out->released_.push_back({.parameter = p, .shape = p.sizes().vec()});
  }
  out->release_all();
  return out;
}

void ReleasedParameters::release_all() {
  torch::NoGradGuard no_grad;
  for (Released& r : released_) {
    // set_data keeps the TensorImpl (and so the Parameter's identity); a
    // gradient of the old shape would no longer match it.
    r.parameter.mutable_grad() = at::Tensor();
    r.parameter.set_data(at::empty({0}, r.parameter.options()));
  }
  materialized_ = false;
}

std::unique_ptr<Strategy::Scope> ReleasedParameters::rematerialize(std::unique_ptr<Strategy::Scope> inner) {
  DTRAIN_INTERNAL_ASSERT(!materialized_, "released parameters rematerialised twice (nested full_weights scopes)");
  {
    torch::NoGradGuard no_grad;
    for (Released& r : released_) r.parameter.set_data(at::zeros(r.shape, r.parameter.options()));
  }
  materialized_ = true;
  struct Materialized : Strategy::Scope {
    Materialized(std::shared_ptr<ReleasedParameters> owner, std::unique_ptr<Strategy::Scope> inner)
        : owner(std::move(owner)), inner(std::move(inner)) {}
    ~Materialized() override {
      owner->release_all();
      inner.reset();
    }
    std::shared_ptr<ReleasedParameters> owner;
    std::unique_ptr<Strategy::Scope> inner;
  };
  return std::make_unique<Materialized>(shared_from_this(), std::move(inner));
}

std::int64_t ReleasedParameters::bytes() const {
  std::int64_t total = 0;
  for (const Released& r : released_) {
    std::int64_t n = 1;
    for (std::int64_t d : r.shape) n *= d;
    total += n * static_cast<std::int64_t>(r.parameter.element_size());
  }
  return total;
}

std::unordered_set<const void*> identities(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> out;
  for (const at::Tensor& t : tensors) out.insert(t.unsafeGetTensorImpl());
  return out;
}

}  // namespace dtrain::detail
