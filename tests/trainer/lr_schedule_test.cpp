// LinearLR, CosineAnnealingLR and WarmupCosineLR against the learning rates
// Python's torch.optim.lr_scheduler gives (tests/data/lr_schedules/), and
// their state round trip.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "dtrain/error.h"
#include "dtrain/trainer/lr_schedule.h"
#include "test_paths.h"

namespace {
nlohmann::json reference() {
  std::ifstream in(dtrain::testing::source_dir() + "/tests/data/lr_schedules/lr_schedules.json");
  return nlohmann::json::parse(in);
}

struct Fixture {
  std::vector<at::Tensor> params = {at::zeros({1}, at::requires_grad()), at::zeros({1}, at::requires_grad())};
  std::unique_ptr<torch::optim::SGD> opt;
  explicit Fixture(const std::vector<double>& base) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (size_t i = 0; i < base.size(); ++i) {
      groups.emplace_back(std::vector<at::Tensor>{params[i]}, std::make_unique<torch::optim::SGDOptions>(base[i]));
    }
    opt = std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(base[0]));
  }
  std::vector<double> lrs() const {
    std::vector<double> out;
    for (auto& g : opt->param_groups()) out.push_back(g.options().get_lr());
    return out;
  }
};

std::unique_ptr<dtrain::ScheduledLR> make(const nlohmann::json& c, torch::optim::Optimizer& opt) {
  const std::string kind = c["kind"];
  if (kind == "linear") {
    return std::make_unique<dtrain::LinearLR>(
        opt, dtrain::LinearLROptions{
                 .start_factor = c["start_factor"], .end_factor = c["end_factor"], .total_steps = c["total_steps"]});
  }
  if (kind == "cosine") {
    return std::make_unique<dtrain::CosineAnnealingLR>(
        opt, dtrain::CosineLROptions{.t_max = c["t_max"], .eta_min = c["eta_min"]});
  }
  return std::make_unique<dtrain::WarmupCosineLR>(opt, dtrain::WarmupCosineOptions{.warmup_steps = c["warmup_steps"],
                                                                                   .total_steps = c["total_steps"],
                                                                                   .start_factor = c["start_factor"],
                                                                                   .eta_min = c["eta_min"]});
}
}  // namespace

TEST(LrSchedule, EqualsPythonLrScheduler) {
  const auto data = reference();
  const auto base = data["base_lrs"].get<std::vector<double>>();
  for (const auto& c : data["cases"]) {
    Fixture f(base);
    auto schedule = make(c, *f.opt);
    const auto& expected = c["lrs"];
    for (size_t k = 0; k < expected.size(); ++k) {
      if (k > 0) {
        f.opt->step();
        schedule->step();
      }
      const auto got = f.lrs();
      for (size_t g = 0; g < got.size(); ++g) {
        const double want = expected[k][g];
        EXPECT_NEAR(got[g], want, 1e-12 * std::max(1.0, std::abs(want))) << c.dump() << " step " << k << " group " << g;
      }
      EXPECT_EQ(schedule->last_step(), static_cast<std::int64_t>(k));
    }
  }
}

TEST(LrSchedule, StateRoundTripResumesTheSchedule) {
  Fixture a({0.5, 0.05});
  dtrain::WarmupCosineLR first(*a.opt, {.warmup_steps = 3, .total_steps = 10, .start_factor = 0.1});
  for (int k = 0; k < 5; ++k) first.step();
  const std::string state = first.to_json();
  first.step();
  const auto expected = a.lrs();

  Fixture b({0.9, 0.9});  // other base rates: the state carries the base
  dtrain::WarmupCosineLR second(*b.opt, {.warmup_steps = 3, .total_steps = 10, .start_factor = 0.1});
  second.load_json(state);
  EXPECT_EQ(second.last_step(), 5);
  EXPECT_EQ(b.lrs(), first.lrs_at(5));
  second.step();
  EXPECT_EQ(b.lrs(), expected);
  EXPECT_THROW(second.load_json("{\"last_epoch\": 1, \"base_lrs\": [0.1]}"), dtrain::ConfigError);
  EXPECT_THROW(dtrain::LinearLR(*b.opt, {.start_factor = 0}), dtrain::ConfigError);
}
