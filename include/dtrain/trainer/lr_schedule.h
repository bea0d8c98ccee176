// Learning-rate schedules LibTorch lacks, as torch::optim::LRScheduler
// subclasses: linear warm-up (Python's LinearLR), cosine decay
// (CosineAnnealingLR), and warm-up then cosine (SequentialLR of the two).
//
//   torch::optim::AdamW opt(params, 3e-4);
//   dtrain::WarmupCosineLR schedule(opt, {.warmup_steps = 100, .total_steps = 5000});
//   for (...) { ...; opt.step(); schedule.step(); }
//
// As in Python, constructing a schedule sets the optimizer's learning rates to
// their value at step 0 (base x the schedule's factor at 0), and after k
// calls of step() they are the values at step k; the base rates are the
// optimizer's at construction, per parameter group. Values are computed in
// closed form, equal to Python's (recursive) ones to ~1e-15 relative
// (tests/trainer/lr_schedule_test.cpp against tests/data/lr_schedules/).
//
// State for checkpoints: to_json() / load_json() ({"last_epoch", "base_lrs"},
// Python's state_dict keys); loading sets the rates of the loaded step.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

// The common part: a factor of the base rates per step, in closed form.
class ScheduledLR : public torch::optim::LRScheduler {
 public:
  explicit ScheduledLR(torch::optim::Optimizer& optimizer);

  // The step the current rates belong to (Python's last_epoch).
  std::int64_t last_step() const { return step_count_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  // The learning rates of every parameter group at `step`.
  std::vector<double> lrs_at(std::int64_t step) const;

  std::string to_json() const;
  // Throws ConfigError on a malformed text or a different number of groups.
  void load_json(const std::string& json);

 protected:
  // The multiplier of the base rate at `step` (base_lr is given for schedules
  // with an absolute floor such as eta_min).
  virtual double lr_at(double base_lr, std::int64_t step) const = 0;
  // Subclasses call this at the end of their constructor (Python's initial step).
  void apply_initial();

 private:
  std::vector<double> get_lrs() override;
  void set_lrs(const std::vector<double>& lrs);

  torch::optim::Optimizer& optimizer_;
  std::vector<double> base_lrs_;
};

struct LinearLROptions {
  double start_factor = 1.0 / 3.0;  // (0, 1]
  double end_factor = 1.0;          // [0, 1]
  std::int64_t total_steps = 5;     // steps to go from start to end; constant after
};

// base x (start + (end - start) x min(step, total) / total): the linear warm-up.
class LinearLR : public ScheduledLR {
 public:
  LinearLR(torch::optim::Optimizer& optimizer, LinearLROptions options);

 private:
  double lr_at(double base_lr, std::int64_t step) const override;
  LinearLROptions options_;
};

struct CosineLROptions {
  std::int64_t t_max = 1;  // steps from base to eta_min
  double eta_min = 0.0;
};

// eta_min + (base - eta_min) (1 + cos(pi step / t_max)) / 2, periodic past
// t_max as Python's.
class CosineAnnealingLR : public ScheduledLR {
 public:
  CosineAnnealingLR(torch::optim::Optimizer& optimizer, CosineLROptions options);

 private:
  double lr_at(double base_lr, std::int64_t step) const override;
  CosineLROptions options_;
};

struct WarmupCosineOptions {
  std::int64_t warmup_steps = 0;  // linear from start_factor x base to base (0: no warm-up)
  std::int64_t total_steps = 1;   // warm-up + cosine; the cosine's t_max is total - warmup
  double start_factor = 0.0;      // Python's LinearLR needs > 0; 0 here starts at lr 0
  double eta_min = 0.0;
};

// Linear warm-up, then cosine decay to eta_min at total_steps: Python's
// SequentialLR([LinearLR(start_factor, 1, warmup), CosineAnnealingLR(total - warmup, eta_min)], [warmup]).
class WarmupCosineLR : public ScheduledLR {
 public:
  WarmupCosineLR(torch::optim::Optimizer& optimizer, WarmupCosineOptions options);

 private:
  double lr_at(double base_lr, std::int64_t step) const override;
  WarmupCosineOptions options_;
};

}  // namespace dtrain
