// LibTorch AdamW/SGD state as Python's optimizer.state_dict().
#include "dtrain/checkpoint/optimizer_state.h"

#include <ATen/Functions.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "dtrain/error.h"

namespace dtrain::checkpoint {
namespace {

using Dict = c10::impl::GenericDict;

Dict dict() {
  return Dict(c10::AnyType::get(), c10::AnyType::get());
}

// Python's param_group keys, in Python's order, for the optimizers it knows
// (torch 2.15's AdamW and SGD defaults for the flags LibTorch lacks).
Dict group_options(const torch::optim::OptimizerOptions& options) {
  Dict g = dict();
  if (const auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    g.insert("lr", o->lr());
    g.insert("betas", c10::ivalue::Tuple::create({std::get<0>(o->betas()), std::get<1>(o->betas())}));
    g.insert("eps", o->eps());
    g.insert("weight_decay", o->weight_decay());
    g.insert("amsgrad", o->amsgrad());
    g.insert("maximize", false);
    g.insert("foreach", c10::IValue());
    g.insert("capturable", false);
    g.insert("differentiable", false);
    g.insert("fused", c10::IValue());
    g.insert("decoupled_weight_decay", true);
  } else if (const auto* s = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    g.insert("lr", s->lr());
    g.insert("momentum", s->momentum());
    g.insert("dampening", s->dampening());
    g.insert("weight_decay", s->weight_decay());
    g.insert("nesterov", s->nesterov());
    g.insert("maximize", false);
    g.insert("foreach", c10::IValue());
    g.insert("differentiable", false);
    g.insert("fused", c10::IValue());
  } else {
    DTRAIN_CHECK(false, ConfigError, "python_optimizer_state_dict knows AdamW and SGD only.",
                 "save this optimizer's state with torch::save, or add its structure to optimizer_state.cpp");
  }
  return g;
}

Dict param_state(const torch::optim::OptimizerParamState& state, bool amsgrad) {
  Dict s = dict();
  if (const auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    // Python keeps the step as a float32 scalar tensor.
    s.insert("step", at::scalar_tensor(static_cast<double>(a->step()), at::kFloat));
    s.insert("exp_avg", a->exp_avg());
    s.insert("exp_avg_sq", a->exp_avg_sq());
    if (amsgrad) s.insert("max_exp_avg_sq", a->max_exp_avg_sq());
  } else if (const auto* m = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    s.insert("momentum_buffer", m->momentum_buffer().defined() ? c10::IValue(m->momentum_buffer()) : c10::IValue());
  } else {
    DTRAIN_CHECK(false, ConfigError, "python_optimizer_state_dict knows AdamW and SGD state only.", "");
  }
  return s;
}

}  // namespace

c10::IValue python_optimizer_state_dict(const torch::optim::Optimizer& optimizer) {
  Dict state = dict();
  c10::impl::GenericList groups(c10::AnyType::get());
  std::int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    Dict g = group_options(group.options());
    const auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&group.options());
    c10::impl::GenericList params(c10::AnyType::get());
    for (const auto& p : group.params()) {
      const auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it != optimizer.state().end()) state.insert(index, param_state(*it->second, adamw && adamw->amsgrad()));
      params.push_back(index++);
    }
    g.insert("params", params);
    groups.push_back(g);
  }
  Dict out = dict();
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

}  // namespace dtrain::checkpoint
