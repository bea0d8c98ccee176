// GradScaler: dynamic loss scaling for mixed-precision training, the
// algorithm, defaults and errors of Python's torch.amp.GradScaler.
//
//   dtrain::amp::GradScaler scaler;                    // scale 2^16, x2 per 2000 clean steps, x0.5 on inf
//   for (...) {
//     opt.zero_grad();
//     at::Tensor loss;
//     { dtrain::amp::Autocast autocast(c10::kCUDA); loss = loss_fn(model(x), y); }
//     scaler.scale(loss).backward();                   // gradients of loss * scale
//     scaler.unscale_(opt);                            // optional: before clipping or inspecting gradients
//     dtrain::clip_grad_norm_(model->parameters(), 1.0);
//     scaler.step(opt);                                // unscales (if not yet), skips the step on inf/NaN
//     scaler.update();                                 // backs off after a skip, or grows
//   }
//
// fp16 gradients underflow without scaling; scaling makes some overflow to
// inf instead, and those steps are skipped while the scale calibrates. bf16
// has fp32's range, so bf16 autocast (the CPU's) rarely needs a scaler; it is
// harmless there (and Python's bench peer uses one, so ours does too).
//
// Distributed runs: every rank must skip the same steps, or replicas diverge.
// Under DDP the averaged gradients are identical on every rank, so the
// decisions agree by themselves; when ranks hold different gradients (ZeRO
// shards, pipeline stages, or anything that touches gradients per rank after
// the reduction) set `found_inf_group`: unscale_() then all-reduces the
// found-inf flag (MAX) over that group, once per optimizer per step, before
// any decision. See Note [Found-inf reduction] in src/amp/grad_scaler.cpp.
//
// Not thread-safe; one scaler per training loop. The scale lives on the device
// of the first tensor given to scale() (a 0-dim fp32 tensor), so no call but
// step() and get_scale() synchronizes with a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace dtrain::amp {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;   // > 1
  double backoff_factor = 0.5;  // < 1
  std::int64_t growth_interval = 2000;
  // False: scale() and unscale_() pass through, step() always steps, update() does nothing.
  bool enabled = true;
  // Ranks whose found-inf flags are combined (MAX) before deciding whether to
  // step: every rank taking part in the same optimizer step when their
  // gradients differ (ZeRO: the shard group; pipeline: all stages; in doubt,
  // the world). Unset: this rank decides alone (single process, DDP).
  std::optional<dist::ProcessGroup> found_inf_group;
};

// The part of a scaler's state a checkpoint keeps (Python's state_dict keys).
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  std::int64_t growth_tracker = 0;  // consecutive unskipped steps since the last scale change

  bool operator==(const GradScalerState&) const = default;
};
// JSON with Python's state_dict keys ({"scale", "growth_factor", "backoff_factor",
// "growth_interval", "_growth_tracker"}), e.g. for a checkpoint's state.json.
std::string to_json(const GradScalerState& state);
// Throws ConfigError naming a missing or mistyped key.
GradScalerState grad_scaler_state_from_json(const std::string& json);

class GradScaler {
 public:
  // Throws ConfigError when enabled with growth_factor <= 1 or backoff_factor >= 1.
  explicit GradScaler(GradScalerOptions options = {});

  // `outputs` times the current scale (unchanged when disabled). The first
  // call creates the scale on `outputs`' device.
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);

  // Divides the gradients of `optimizer`'s parameters by the scale, in place,
  // and records whether any is inf or NaN (all-reduced over found_inf_group).
  // At most once per optimizer between update()s, and not after step().
  // Throws ConfigError for fp16 gradients (fp16 master weights cannot be
  // unscaled safely; keep parameters in fp32 and autocast the forward).
  void unscale_(torch::optim::Optimizer& optimizer);

  // Unscales (unless unscale_ was called) and calls optimizer.step() unless a
  // gradient was inf/NaN. Returns whether the step was taken. Once per
  // optimizer between update()s. Disabled: always steps.
  bool step(torch::optim::Optimizer& optimizer);

  // Backs the scale off if any optimizer's gradients were non-finite this
  // iteration, else counts a clean step and grows it after growth_interval of
  // them; then forgets the per-optimizer states. Call once per iteration,
  // after step() for every optimizer. `new_scale` sets the scale instead.
  void update(std::optional<double> new_scale = std::nullopt);

  // The current scale (init_scale before the first scale(); 1 when disabled).
  // Synchronizes with the device holding the scale.
  double get_scale() const;
  // Consecutive unskipped steps since the scale last changed.
  std::int64_t growth_tracker() const;
  bool is_enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }
  void set_growth_factor(double factor);
  void set_backoff_factor(double factor);
  void set_growth_interval(std::int64_t interval);

  // nullopt when disabled (Python returns {}). Take it after update().
  std::optional<GradScalerState> state_dict() const;
  // A no-op when disabled; otherwise replaces scale, factors, interval and tracker.
  void load_state_dict(const GradScalerState& state);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    // 0-dim fp32 on the scale's device: > 0 when a gradient was inf/NaN
    // (on any rank of found_inf_group). Undefined until unscale_.
    at::Tensor found_inf;
  };

  void check_initialized(const char* method) const;
  OptimizerState& state_of(const torch::optim::Optimizer& optimizer);

  GradScalerOptions options_;
  double init_scale_;
  std::int64_t init_growth_tracker_ = 0;
  at::Tensor scale_;           // 0-dim fp32, created by the first scale()
  at::Tensor growth_tracker_;  // 0-dim int32, beside scale_
  std::unordered_map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
};

}  // namespace dtrain::amp
