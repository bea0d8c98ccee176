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

double number(const Dict& group, const char* key) {
  DTRAIN_CHECK(group.contains(key), DataError, "a param group has no '" << key << "'.",
               "give the state dict of a Python optimizer of the same kind");
  const auto v = group.at(key);
  DTRAIN_CHECK(v.isDouble() || v.isInt() || v.isBool(), DataError, "param group entry '" << key << "' is not a number.",
               "");
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.isInt() ? v.toInt() : v.toBool());
}

// Python's flags that change the update and that LibTorch's optimizers lack.
void check_python_only_flags(const Dict& group) {
  for (const char* key : {"maximize", "capturable", "differentiable"})
    DTRAIN_CHECK(!group.contains(key) || group.at(key).isNone() || !group.at(key).toBool(), ConfigError,
                 "the Python optimizer ran with " << key << "=True, which LibTorch's has no counterpart for.", "");
  DTRAIN_CHECK(!group.contains("decoupled_weight_decay") || group.at("decoupled_weight_decay").toBool(), ConfigError,
               "the Python optimizer is Adam (decoupled_weight_decay=False), not AdamW.",
               "load it into torch::optim::Adam");
}

// A Python param group's options into LibTorch's AdamW or SGD options.
void apply_group(const Dict& group, std::size_t g, torch::optim::AdamWOptions* adamw, torch::optim::SGDOptions* sgd) {
  if (adamw) {
    DTRAIN_CHECK(
        group.contains("betas") && group.at("betas").isTuple() && group.at("betas").toTupleRef().elements().size() == 2,
        DataError, "param group " << g << " has no betas pair: not an Adam-family optimizer's state.",
        "load it into the optimizer Python saved it from");
    const auto betas = group.at("betas").toTupleRef().elements();
    adamw->lr(number(group, "lr")).eps(number(group, "eps")).weight_decay(number(group, "weight_decay"));
    adamw->betas({betas.at(0).toDouble(), betas.at(1).toDouble()}).amsgrad(number(group, "amsgrad") != 0);
  } else {
    sgd->lr(number(group, "lr")).momentum(number(group, "momentum")).dampening(number(group, "dampening"));
    sgd->weight_decay(number(group, "weight_decay")).nesterov(number(group, "nesterov") != 0);
  }
}

at::Tensor state_tensor(const Dict& s, const char* key, const at::Tensor& param, std::int64_t index) {
  DTRAIN_CHECK(s.contains(key) && s.at(key).isTensor(), DataError,
               "the state of parameter " << index << " has no tensor '" << key << "'.", "");
  const at::Tensor t = s.at(key).toTensor();
  DTRAIN_CHECK(t.sizes() == param.sizes(), DataError,
               "state '" << key << "' of parameter " << index << " has shape " << t.sizes() << ", the parameter "
                         << param.sizes() << ".",
               "build the optimizer over the same parameters in the same order");
  return t.to(param.options()).clone();
}

void load_state(torch::optim::Optimizer& optimizer, const c10::IValue& state_dict) {
  DTRAIN_CHECK(state_dict.isGenericDict() && state_dict.toGenericDict().contains("state") &&
                   state_dict.toGenericDict().contains("param_groups"),
               DataError, "not an optimizer state dict (no 'state' and 'param_groups').",
               "pass the value of optimizer.state_dict()");
  const Dict sd = state_dict.toGenericDict();
  const Dict state = sd.at("state").toGenericDict();
  const auto groups = sd.at("param_groups").toList();
  auto& ours = optimizer.param_groups();
  DTRAIN_CHECK(groups.size() == ours.size(), DataError,
               "the state dict has " << groups.size() << " param groups, the optimizer " << ours.size() << ".", "");
  std::int64_t index = 0;
  for (std::size_t g = 0; g < ours.size(); ++g) {
    const Dict group = groups.get(g).toGenericDict();
    check_python_only_flags(group);
    const auto params = group.at("params").toList();
    DTRAIN_CHECK(params.size() == ours[g].params().size(), DataError,
                 "param group " << g << " has " << params.size() << " parameters, the optimizer's "
                                << ours[g].params().size() << ".",
                 "");
    auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&ours[g].options());
    auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&ours[g].options());
    DTRAIN_CHECK(adamw || sgd, ConfigError, "load_python_optimizer_state_dict knows AdamW and SGD only.", "");
    apply_group(group, g, adamw, sgd);
    for (std::size_t i = 0; i < params.size(); ++i, ++index) {
      const at::Tensor& p = ours[g].params()[i];
      const std::int64_t key = params.get(i).toInt();
      optimizer.state().erase(p.unsafeGetTensorImpl());
      if (!state.contains(key)) continue;
      const Dict s = state.at(key).toGenericDict();
      if (adamw) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        DTRAIN_CHECK(s.contains("step"), DataError, "the state of parameter " << index << " has no step.", "");
        const auto step = s.at("step");
        fresh->step(step.isTensor() ? static_cast<std::int64_t>(step.toTensor().item<double>())
                                    : static_cast<std::int64_t>(step.toDouble()));
        fresh->exp_avg(state_tensor(s, "exp_avg", p, index));
        fresh->exp_avg_sq(state_tensor(s, "exp_avg_sq", p, index));
        if (adamw->amsgrad()) fresh->max_exp_avg_sq(state_tensor(s, "max_exp_avg_sq", p, index));
        optimizer.state()[p.unsafeGetTensorImpl()] = std::move(fresh);
      } else if (s.contains("momentum_buffer") && s.at("momentum_buffer").isTensor()) {
        auto fresh = std::make_unique<torch::optim::SGDParamState>();
        fresh->momentum_buffer(state_tensor(s, "momentum_buffer", p, index));
        optimizer.state()[p.unsafeGetTensorImpl()] = std::move(fresh);
      }
    }
  }
}

}  // namespace

c10::impl::GenericDict python_param_group(const torch::optim::OptimizerOptions& options) {
  return group_options(options);
}

std::shared_ptr<torch::optim::OptimizerOptions> options_from_python_param_group(const c10::impl::GenericDict& group) {
  check_python_only_flags(group);
  if (group.contains("betas")) {
    auto options = std::make_shared<torch::optim::AdamWOptions>();
    apply_group(group, 0, options.get(), nullptr);
    return options;
  }
  DTRAIN_CHECK(group.contains("momentum"), DataError,
               "the param group is neither AdamW's (betas) nor SGD's (momentum).", "convert AdamW or SGD state");
  auto options = std::make_shared<torch::optim::SGDOptions>(0.0);
  apply_group(group, 0, nullptr, options.get());
  return options;
}

void load_python_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state_dict) {
  // Values of the wrong kind where the checks above do not look (a list that
  // is a dict, a missing "params") surface as c10 or std errors: the same
  // DataError for all of them.
  try {
    load_state(optimizer, state_dict);
  } catch (const dtrain::Error&) {
    throw;
  } catch (const c10::Error& e) {
    DTRAIN_CHECK(false, DataError, "the optimizer state dict is malformed (" << e.what_without_backtrace() << ").",
                 "pass the value of a Python optimizer.state_dict() for this optimizer");
  } catch (const std::exception& e) {
    DTRAIN_CHECK(false, DataError, "the optimizer state dict is malformed (" << e.what() << ").",
                 "pass the value of a Python optimizer.state_dict() for this optimizer");
  }
}

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
