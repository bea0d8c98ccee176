// Closed-form learning-rate schedules over LibTorch's LRScheduler.
#include "dtrain/trainer/lr_schedule.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>

#include "dtrain/error.h"

namespace dtrain {

ScheduledLR::ScheduledLR(torch::optim::Optimizer& optimizer)
    : torch::optim::LRScheduler(optimizer), optimizer_(optimizer), base_lrs_(get_current_lrs()) {}

std::vector<double> ScheduledLR::lrs_at(std::int64_t step) const {
  std::vector<double> lrs;
  lrs.reserve(base_lrs_.size());
  for (const double base : base_lrs_) lrs.push_back(lr_at(base, step));
  return lrs;
}

void ScheduledLR::apply_initial() {
  set_lrs(lrs_at(0));
}

// LRScheduler::step() calls this before counting the step: the rates of the
// step about to be reached.
std::vector<double> ScheduledLR::get_lrs() {
  return lrs_at(static_cast<std::int64_t>(step_count_) + 1);
}

void ScheduledLR::set_lrs(const std::vector<double>& lrs) {
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size() && i < lrs.size(); ++i) groups[i].options().set_lr(lrs[i]);
}

std::string ScheduledLR::to_json() const {
  return nlohmann::json{{"last_epoch", static_cast<std::int64_t>(step_count_)}, {"base_lrs", base_lrs_}}.dump();
}

void ScheduledLR::load_json(const std::string& json) {
  std::int64_t last = 0;
  std::vector<double> base;
  try {
    const auto j = nlohmann::json::parse(json);
    last = j.at("last_epoch").get<std::int64_t>();
    base = j.at("base_lrs").get<std::vector<double>>();
  } catch (const std::exception& e) {
    DTRAIN_CHECK(false, ConfigError, "unreadable learning-rate schedule state: " << e.what(),
                 "load a state written by to_json()");
  }
  DTRAIN_CHECK(base.size() == base_lrs_.size() && last >= 0, ConfigError,
               "the schedule state has " << base.size() << " parameter groups at step " << last << ", the optimizer "
                                         << base_lrs_.size() << ".",
               "load it into a schedule over the same optimizer");
  base_lrs_ = std::move(base);
  step_count_ = static_cast<unsigned>(last);
  set_lrs(lrs_at(last));
}

LinearLR::LinearLR(torch::optim::Optimizer& optimizer, LinearLROptions options)
    : ScheduledLR(optimizer), options_(options) {
  DTRAIN_CHECK(options_.start_factor > 0 && options_.start_factor <= 1 && options_.end_factor >= 0 &&
                   options_.end_factor <= 1 && options_.total_steps >= 1,
               ConfigError,
               "LinearLR needs 0 < start_factor <= 1, 0 <= end_factor <= 1 and total_steps >= 1; got "
                   << options_.start_factor << ", " << options_.end_factor << ", " << options_.total_steps << ".",
               "as Python's torch.optim.lr_scheduler.LinearLR");
  apply_initial();
}

double LinearLR::lr_at(double base_lr, std::int64_t step) const {
  const double progress =
      static_cast<double>(std::min(step, options_.total_steps)) / static_cast<double>(options_.total_steps);
  return base_lr * (options_.start_factor + (options_.end_factor - options_.start_factor) * progress);
}

CosineAnnealingLR::CosineAnnealingLR(torch::optim::Optimizer& optimizer, CosineLROptions options)
    : ScheduledLR(optimizer), options_(options) {
  DTRAIN_CHECK(
      options_.t_max >= 1 && options_.eta_min >= 0, ConfigError,
      "CosineAnnealingLR needs t_max >= 1 and eta_min >= 0; got " << options_.t_max << ", " << options_.eta_min << ".",
      "t_max is the number of steps from the base rate to eta_min");
  apply_initial();
}

double CosineAnnealingLR::lr_at(double base_lr, std::int64_t step) const {
  const double phase = std::numbers::pi * static_cast<double>(step) / static_cast<double>(options_.t_max);
  return options_.eta_min + (base_lr - options_.eta_min) * (1 + std::cos(phase)) / 2;
}

WarmupCosineLR::WarmupCosineLR(torch::optim::Optimizer& optimizer, WarmupCosineOptions options)
    : ScheduledLR(optimizer), options_(options) {
  DTRAIN_CHECK(options_.warmup_steps >= 0 && options_.total_steps > options_.warmup_steps &&
                   options_.start_factor >= 0 && options_.start_factor <= 1 && options_.eta_min >= 0,
               ConfigError,
               "WarmupCosineLR needs 0 <= warmup_steps < total_steps, 0 <= start_factor <= 1 and eta_min >= 0; got "
                   << options_.warmup_steps << ", " << options_.total_steps << ", " << options_.start_factor << ", "
                   << options_.eta_min << ".",
               "total_steps counts the warm-up and the decay together");
  apply_initial();
}

double WarmupCosineLR::lr_at(double base_lr, std::int64_t step) const {
  if (step < options_.warmup_steps) {
    const double progress = static_cast<double>(step) / static_cast<double>(options_.warmup_steps);
    return base_lr * (options_.start_factor + (1 - options_.start_factor) * progress);
  }
  const double t_max = static_cast<double>(options_.total_steps - options_.warmup_steps);
  const double phase = std::numbers::pi * static_cast<double>(step - options_.warmup_steps) / t_max;
  return options_.eta_min + (base_lr - options_.eta_min) * (1 + std::cos(phase)) / 2;
}

}  // namespace dtrain
