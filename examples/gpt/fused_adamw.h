// AdamW whose step is one fused ATen kernel per parameter group
// (at::_fused_adamw_, the kernel behind Python's AdamW(fused=True)), instead of
// torch::optim::AdamW's dozen small ops per parameter. On a model of many
// small tensors (a GPT has ~30) those per-op dispatches are a visible share of
// a CPU step.
//
// It is a torch::optim::AdamW: same options, same per-parameter state
// (AdamWParamState), same save/load, so checkpoints and the Checkpointer work
// unchanged and either class can resume the other's state. Decoupled weight
// decay, bias correction and eps placement are AdamW's (tests/unit/gpt_test.cpp
// checks it against torch::optim::AdamW, rtol 1e-6). Parameters on several
// devices (model parallelism) get one kernel call per device.
//
// TODO(library): belongs in dtrain's optimizer layer (with a foreach
// clip_grad_norm_) once there is one; see the GPT issue's report.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

namespace gpt {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  torch::Tensor step(LossClosure closure = nullptr) override {
    TORCH_CHECK(!closure, "FusedAdamW::step takes no closure");
    at::NoGradGuard no_grad;
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
      std::vector<std::pair<c10::Device, Lists>> by_device;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        TORCH_CHECK(!p.grad().is_sparse(), "FusedAdamW does not support sparse gradients");
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<torch::optim::AdamWParamState>();
          fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
          fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          if (o.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          slot = std::move(fresh);
        }
        auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
        auto on =
            std::find_if(by_device.begin(), by_device.end(), [&](const auto& d) { return d.first == p.device(); });
        if (on == by_device.end()) on = by_device.insert(on, {p.device(), Lists{}});
        auto& [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps] = on->second;
        params.push_back(p);
        grads.push_back(p.grad());
        exp_avgs.push_back(s.exp_avg());
        exp_avg_sqs.push_back(s.exp_avg_sq());
        if (o.amsgrad()) max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
        // The kernel reads the step count of this update (Python increments its
        // float counters before the call); ours stays the int64 in
        // AdamWParamState, the form AdamW saves.
        s.step(s.step() + 1);
        steps.push_back(at::scalar_tensor(static_cast<double>(s.step()), p.options().dtype(at::kFloat)));
      }
      for (auto& [device, l] : by_device) {
        at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.max_exp_avg_sqs, l.steps, o.lr(),
                          std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(), o.amsgrad(),
                          /*maximize=*/false);
      }
    }
    return {};
  }

 private:
  struct Lists {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  };
};

// Scales all gradients so their global 2-norm is at most max_norm (as
// torch.nn.utils.clip_grad_norm_, with foreach kernels: two dispatches instead
// of two per parameter); returns the norm before clipping.
inline double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return 0.0;
  std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2);
  for (auto& n : norms) n = n.to(grads.front().device());  // model parallelism: gather the norms
  const at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  const double norm = total.item<double>();
  // As torch's: float32 arithmetic, and a multiply even when nothing is clipped.
  const float coef = std::min(static_cast<float>(max_norm) / (static_cast<float>(norm) + 1e-6f), 1.0f);
  at::_foreach_mul_(grads, at::Scalar(coef));
  return norm;
}

}  // namespace gpt
