#include "dtrain/nn/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <optional>
#include <utility>

#include "dtrain/error.h"

namespace dtrain::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The device types whose autocast state the recompute reproduces.
constexpr c10::DeviceType kAutocastDevices[] = {c10::kCPU, c10::kCUDA};

struct AutocastState {
  bool enabled = false;
  c10::ScalarType dtype = c10::kFloat;
};

// A generator and its state at forward.
struct GeneratorState {
  at::Generator generator;
  c10::intrusive_ptr<c10::TensorImpl> state;
};

c10::intrusive_ptr<c10::TensorImpl> state_of(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state().getIntrusivePtr();
}

void set_state(at::Generator& generator, const c10::intrusive_ptr<c10::TensorImpl>& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(at::Tensor(state));
}

// What the recompute needs besides the saved inputs: the function, the
// parameters (held by reference: they live as long as the model), and the
// random and autocast state fn saw at forward.
struct Recompute : torch::CustomClassHolder {
  CheckpointFn fn;
  std::vector<at::Tensor> params;
  std::vector<bool> input_is_float;
  std::vector<GeneratorState> generators;
  AutocastState autocast[std::size(kAutocastDevices)];
};

// The generators fn may draw from: the CPU's and those of the inputs' other
// devices.
std::vector<GeneratorState> capture_generators(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Generator> generators{at::globalContext().defaultGenerator(c10::kCPU)};
  for (const at::Tensor& t : inputs) {
    if (!t.defined() || t.device().is_cpu()) continue;
    at::Generator g = at::globalContext().defaultGenerator(t.device());
    bool seen = false;
    for (const at::Generator& h : generators) seen = seen || h == g;
    if (!seen) generators.push_back(std::move(g));
  }
  std::vector<GeneratorState> states;
  for (at::Generator& g : generators) states.push_back({g, state_of(g)});
  return states;
}

// Puts the forward's generator and autocast state in place for the
// recompute, and back as it found them afterwards.
class ForwardStateGuard {
 public:
  explicit ForwardStateGuard(Recompute& r) {
    for (GeneratorState& g : r.generators) {
      current_.push_back({g.generator, state_of(g.generator)});
      set_state(g.generator, g.state);
    }
    for (std::size_t i = 0; i < std::size(kAutocastDevices); ++i) {
      const c10::DeviceType d = kAutocastDevices[i];
      autocast_[i] = {at::autocast::is_autocast_enabled(d), at::autocast::get_autocast_dtype(d)};
      at::autocast::set_autocast_enabled(d, r.autocast[i].enabled);
      at::autocast::set_autocast_dtype(d, r.autocast[i].dtype);
    }
    // No cached low-precision weights: the recompute runs outside every
    // Autocast region, so nothing would clear them before the optimizer
    // changes the weights.
    cache_enabled_ = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~ForwardStateGuard() {
    at::autocast::set_autocast_cache_enabled(cache_enabled_);
    for (GeneratorState& g : current_) set_state(g.generator, g.state);
    for (std::size_t i = 0; i < std::size(kAutocastDevices); ++i) {
      at::autocast::set_autocast_enabled(kAutocastDevices[i], autocast_[i].enabled);
      at::autocast::set_autocast_dtype(kAutocastDevices[i], autocast_[i].dtype);
    }
  }
  ForwardStateGuard(const ForwardStateGuard&) = delete;
  ForwardStateGuard& operator=(const ForwardStateGuard&) = delete;

 private:
  std::vector<GeneratorState> current_;
  AutocastState autocast_[std::size(kAutocastDevices)];
  bool cache_enabled_ = true;
};

// Inputs: the state (not a tensor: no gradient), the inputs, the params, in
// that order; backward returns one gradient per entry.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static at::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<Recompute> r, at::TensorList inputs,
                            at::TensorList /*params: in r, listed here for their edges*/) {
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(r);
    // The function runs without autograd here (Function::apply turns it
    // off), so nothing it computes is saved for backward.
    return r->fn(inputs.vec());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    DTRAIN_CHECK(!at::GradMode::is_enabled(), ConfigError,
                 "a checkpointed (recomputed) region was differentiated with create_graph.",
                 "higher-order gradients through dtrain::nn::checkpoint are not supported; run that part "
                 "without recompute");
    auto r = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> wanted;      // what the gradients are taken of
    std::vector<std::size_t> wanted_at;  // their slot in the result
    // Result slot 0 is the state; inputs follow, then params. Autograd's
    // edges (needs_input_grad) count the tensors only.
    for (std::size_t i = 0; i < saved.size(); ++i) {
      at::Tensor x = saved[i].detach();
      if (r->input_is_float[i] && ctx->needs_input_grad(i)) {
        x.requires_grad_(true);
        wanted.push_back(x);
        wanted_at.push_back(1 + i);
      }
      inputs.push_back(std::move(x));
    }
    for (std::size_t j = 0; j < r->params.size(); ++j) {
      const std::size_t slot = 1 + saved.size() + j;
      if (r->params[j].requires_grad() && ctx->needs_input_grad(slot - 1)) {
        wanted.push_back(r->params[j]);
        wanted_at.push_back(slot);
      }
    }
    at::Tensor output;
    {
      ForwardStateGuard same_as_forward(*r);
      at::AutoGradMode grad_mode(true);
      output = r->fn(inputs);
    }
    variable_list result(1 + saved.size() + r->params.size());
    if (wanted.empty() || !output.requires_grad()) return result;
    const variable_list computed = torch::autograd::grad({output}, wanted, {grads[0]}, /*retain_graph=*/false,
                                                         /*create_graph=*/false, /*allow_unused=*/true);
    for (std::size_t k = 0; k < wanted.size(); ++k) result[wanted_at[k]] = computed[k];
    return result;
  }
};

}  // namespace

at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& params) {
  bool any_requires_grad = false;
  for (const at::Tensor& t : inputs) any_requires_grad = any_requires_grad || (t.defined() && t.requires_grad());
  for (const at::Tensor& t : params) any_requires_grad = any_requires_grad || t.requires_grad();
  if (!at::GradMode::is_enabled() || !any_requires_grad) return fn(inputs);
  for (const at::Tensor& t : inputs)
    DTRAIN_CHECK(t.defined(), ConfigError, "checkpoint got an undefined input tensor.",
                 "pass only defined tensors as inputs; close over optional ones in fn");

  auto r = c10::make_intrusive<Recompute>();
  r->fn = fn;
  r->params = params;
  for (const at::Tensor& t : inputs) r->input_is_float.push_back(at::isFloatingType(t.scalar_type()));
  r->generators = capture_generators(inputs);
  for (std::size_t i = 0; i < std::size(kAutocastDevices); ++i)
    r->autocast[i] = {at::autocast::is_autocast_enabled(kAutocastDevices[i]),
                      at::autocast::get_autocast_dtype(kAutocastDevices[i])};
  return CheckpointFunction::apply(r, at::TensorList(inputs), at::TensorList(params));
}

}  // namespace dtrain::nn
