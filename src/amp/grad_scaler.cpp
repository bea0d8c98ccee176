// GradScaler: torch/amp/grad_scaler.py's algorithm over ATen's AMP kernels
// (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_), plus the
// found-inf reduction over a process group that torch's ShardedGradScaler has.
#include "dtrain/amp/grad_scaler.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <iterator>
#include <nlohmann/json.hpp>
#include <utility>

#include "dtrain/error.h"

namespace dtrain::amp {

// Note [Found-inf reduction]
// Ranks that hold different gradients (ZeRO shards, pipeline stages) each see
// only their own infs; if one rank skipped a step that the others took, the
// replicas (or the shards of one model) would silently diverge. So unscale_()
// combines the flags before anything uses them: the per-device flags of this
// rank are summed into one 0-dim fp32 flag on the scale's device, and that one
// flag is all-reduced with MAX over `found_inf_group`. Doing it in unscale_()
// (which step() calls when the user did not) means clipping in between, step()
// and update() all see the same global answer, at one small collective per
// optimizer per iteration. The collective is made even when this rank holds no
// gradient for the optimizer, so every rank makes the same sequence of
// collectives; the contract is that all ranks call unscale_/step for the same
// optimizers in the same order (as they call backward).

namespace {

constexpr const char* kScaleFirstHint =
    "call scaler.scale(loss).backward() earlier in the iteration (the scale is created by the first scale() call)";

// Gradients of one device and dtype, for one call of the foreach kernel.
struct GradGroup {
  c10::Device device;
  c10::ScalarType dtype;
  std::vector<at::Tensor> grads;
};

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(std::move(options)), init_scale_(options_.init_scale) {
  if (!options_.enabled) return;
  DTRAIN_CHECK(options_.growth_factor > 1.0, ConfigError,
               "GradScaler growth_factor must be > 1, got " << options_.growth_factor,
               "the default is 2.0 (the scale doubles after growth_interval clean steps)");
  DTRAIN_CHECK(options_.backoff_factor < 1.0, ConfigError,
               "GradScaler backoff_factor must be < 1, got " << options_.backoff_factor,
               "the default is 0.5 (the scale halves after a step with inf/NaN gradients)");
  DTRAIN_CHECK(options_.growth_interval >= 1, ConfigError,
               "GradScaler growth_interval must be >= 1, got " << options_.growth_interval,
               "the default is 2000 steps");
}

void GradScaler::check_initialized(const char* method) const {
  DTRAIN_CHECK(scale_.defined(), ConfigError, "GradScaler::" << method << "() before any scale()", kScaleFirstHint);
}

GradScaler::OptimizerState& GradScaler::state_of(const torch::optim::Optimizer& optimizer) {
  return per_optimizer_[&optimizer];
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!options_.enabled) return outputs;
  DTRAIN_CHECK(outputs.defined(), ConfigError, "GradScaler::scale() of an undefined tensor",
               "pass the loss (or outputs) to scale");
  if (!scale_.defined()) {
    scale_ = at::full({}, init_scale_, at::TensorOptions().dtype(at::kFloat).device(outputs.device()));
    growth_tracker_ = at::full({}, init_growth_tracker_, at::TensorOptions().dtype(at::kInt).device(outputs.device()));
  }
  return outputs.mul(scale_.to(outputs.device(), /*non_blocking=*/true));
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  for (const auto& output : outputs) scaled.push_back(scale(output));
  return scaled;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  check_initialized("unscale_");
  OptimizerState& state = state_of(optimizer);
  DTRAIN_CHECK(state.stage != Stage::kUnscaled, ConfigError,
               "GradScaler::unscale_() has already been called on this optimizer since the last update()",
               "call unscale_() at most once per optimizer per iteration, after all backward passes");
  DTRAIN_CHECK(state.stage != Stage::kStepped, ConfigError, "GradScaler::unscale_() after step() on this optimizer",
               "call unscale_() before step(), then update() to start the next iteration");

  at::NoGradGuard no_grad;
  // FP32 division can be imprecise under some compile options: the reciprocal is taken in fp64 (as torch does).
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  std::vector<GradGroup> groups;  // by (device, dtype), in first-seen order
  bool saw_grad = false;
  for (const auto& param_group : optimizer.param_groups()) {
    for (const auto& param : param_group.params()) {
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      saw_grad = true;
      DTRAIN_CHECK(grad.scalar_type() != at::kHalf, ConfigError, "GradScaler: attempting to unscale fp16 gradients",
                   "keep the parameters (and so their gradients) in fp32 and run the forward under "
                   "dtrain::amp::Autocast, which computes in fp16 while gradients stay fp32");
      const at::Tensor to_unscale = grad.is_sparse() ? grad._values() : grad;
      auto it = std::find_if(groups.begin(), groups.end(), [&](const GradGroup& g) {
        return g.device == to_unscale.device() && g.dtype == to_unscale.scalar_type();
      });
      if (it == groups.end()) {
        groups.push_back({to_unscale.device(), to_unscale.scalar_type(), {}});
        it = std::prev(groups.end());
      }
      it->grads.push_back(to_unscale);
    }
  }
  DTRAIN_CHECK(saw_grad || options_.found_inf_group.has_value(), ConfigError,
               "GradScaler: no parameter of this optimizer has a gradient",
               "run backward on scaler.scale(loss) before unscale_() or step()");

  at::Tensor found_inf = at::zeros({}, scale_.options());
  for (auto& group : groups) {
    at::Tensor device_found_inf = at::zeros({}, scale_.options().device(group.device));
    at::_amp_foreach_non_finite_check_and_unscale_(group.grads, device_found_inf, inv_scale.to(group.device));
    found_inf.add_(device_found_inf.to(scale_.device()));
  }
  if (options_.found_inf_group) {  // See Note [Found-inf reduction]
    dist::ProcessGroup& group = *options_.found_inf_group;
    at::Tensor flag = found_inf.to(group.device());
    group.all_reduce(flag, dist::ReduceOp::kMax).wait();
    found_inf = flag.to(scale_.device());
  }
  state.found_inf = found_inf;
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  check_initialized("step");
  DTRAIN_CHECK(state_of(optimizer).stage != Stage::kStepped, ConfigError,
               "GradScaler::step() has already been called on this optimizer since the last update()",
               "call update() once per iteration, after step() for every optimizer");
  if (state_of(optimizer).stage == Stage::kReady) unscale_(optimizer);
  OptimizerState& state = state_of(optimizer);
  const bool finite = state.found_inf.item<float>() == 0.0f;
  if (finite) optimizer.step();
  state.stage = Stage::kStepped;
  return finite;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled) return;
  check_initialized("update");
  if (new_scale) {
    scale_.fill_(*new_scale);
  } else {
    at::Tensor found_inf_combined;
    for (const auto& [optimizer, state] : per_optimizer_) {
      if (!state.found_inf.defined()) continue;
      at::Tensor found = state.found_inf.to(scale_.device());
      found_inf_combined = found_inf_combined.defined() ? found_inf_combined.add(found) : found.clone();
    }
    DTRAIN_CHECK(found_inf_combined.defined(), ConfigError,
                 "GradScaler::update() without any unscale_() or step() since the last update()",
                 "call scaler.step(optimizer) (which checks the gradients) before update()");
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf_combined, options_.growth_factor, options_.backoff_factor,
                           options_.growth_interval);
  }
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

std::int64_t GradScaler::growth_tracker() const {
  if (!options_.enabled) return 0;
  return growth_tracker_.defined() ? growth_tracker_.item<std::int64_t>() : init_growth_tracker_;
}

void GradScaler::set_growth_factor(double factor) {
  options_.growth_factor = factor;
}

void GradScaler::set_backoff_factor(double factor) {
  options_.backoff_factor = factor;
}

void GradScaler::set_growth_interval(std::int64_t interval) {
  options_.growth_interval = interval;
}

std::optional<GradScalerState> GradScaler::state_dict() const {
  if (!options_.enabled) return std::nullopt;
  return GradScalerState{.scale = get_scale(),
                         .growth_factor = options_.growth_factor,
                         .backoff_factor = options_.backoff_factor,
                         .growth_interval = options_.growth_interval,
                         .growth_tracker = growth_tracker()};
}

void GradScaler::load_state_dict(const GradScalerState& state) {
  if (!options_.enabled) return;
  init_scale_ = state.scale;
  if (scale_.defined()) scale_.fill_(state.scale);
  options_.growth_factor = state.growth_factor;
  options_.backoff_factor = state.backoff_factor;
  options_.growth_interval = state.growth_interval;
  init_growth_tracker_ = state.growth_tracker;
  if (growth_tracker_.defined()) growth_tracker_.fill_(state.growth_tracker);
}

std::string to_json(const GradScalerState& state) {
  return nlohmann::json{{"scale", state.scale},
                        {"growth_factor", state.growth_factor},
                        {"backoff_factor", state.backoff_factor},
                        {"growth_interval", state.growth_interval},
                        {"_growth_tracker", state.growth_tracker}}
      .dump();
}

GradScalerState grad_scaler_state_from_json(const std::string& json) {
  try {
    const auto j = nlohmann::json::parse(json);
    return {.scale = j.at("scale").get<double>(),
            .growth_factor = j.at("growth_factor").get<double>(),
            .backoff_factor = j.at("backoff_factor").get<double>(),
            .growth_interval = j.at("growth_interval").get<std::int64_t>(),
            .growth_tracker = j.at("_growth_tracker").get<std::int64_t>()};
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(std::string("GradScaler state is not valid: ") + e.what(),
                      "pass what to_json(GradScalerState) (or Python's GradScaler.state_dict(), as JSON) produced");
  }
}

}  // namespace dtrain::amp
