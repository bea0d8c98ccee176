// GradScaler against torch.amp.GradScaler: the scales, skip decisions,
// unscaled gradients and parameters recorded from Python by
// tests/data/amp/gen_grad_scaler.py (grad_scaler.json) must come out
// identical, bit for bit; plus the error cases, the disabled scaler and
// state round trips.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/amp/grad_scaler.h"
#include "dtrain/error.h"
#include "test_paths.h"

using dtrain::amp::GradScaler;
using dtrain::amp::GradScalerOptions;
using dtrain::amp::GradScalerState;
using nlohmann::json;

namespace {

json load_reference(const std::string& name) {
  std::ifstream in(dtrain::testing::source_dir() + "/tests/data/amp/" + name);
  EXPECT_TRUE(in.good()) << "missing test data " << name;
  return json::parse(in);
}

// JSON has no literal for inf/NaN: the generator writes them as strings.
double decode(const json& v) {
  if (v.is_string()) {
    const auto s = v.get<std::string>();
    if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
    return s == "inf" ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
  }
  return v.get<double>();
}

at::Tensor tensor_of(const json& values, const std::vector<std::int64_t>& shape, c10::ScalarType dtype) {
  std::vector<double> flat;
  for (const auto& v : values) flat.push_back(decode(v));
  return at::tensor(flat, at::kDouble).reshape(shape).to(dtype);
}

// Bitwise equality of values (NaN equals NaN).
::testing::AssertionResult same_values(const at::Tensor& t, const json& expected) {
  const at::Tensor d = t.detach().to(at::kDouble).contiguous().reshape(-1);
  if (d.numel() != static_cast<std::int64_t>(expected.size())) return ::testing::AssertionFailure() << "sizes differ";
  for (std::int64_t i = 0; i < d.numel(); ++i) {
    const double a = d[i].item<double>(), b = decode(expected[static_cast<size_t>(i)]);
    if (!(a == b || (std::isnan(a) && std::isnan(b)))) {
      return ::testing::AssertionFailure() << "element " << i << ": " << a << " vs Python's " << b;
    }
  }
  return ::testing::AssertionSuccess();
}

c10::ScalarType dtype_named(const std::string& name) {
  return name == "float64" ? at::kDouble : at::kFloat;
}

GradScalerOptions options_from(const json& j) {
  GradScalerOptions o;
  o.init_scale = j.value("init_scale", o.init_scale);
  o.growth_factor = j.value("growth_factor", o.growth_factor);
  o.backoff_factor = j.value("backoff_factor", o.backoff_factor);
  o.growth_interval = j.value("growth_interval", o.growth_interval);
  return o;
}

// The optimizers of a scenario: SGD over param groups with their own lr.
struct Optimizers {
  std::vector<std::vector<at::Tensor>> params;  // per optimizer, in group order
  std::vector<std::unique_ptr<torch::optim::SGD>> sgd;
};

Optimizers build(const json& layout) {
  Optimizers out;
  for (const auto& opt : layout) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    std::vector<at::Tensor> all;
    for (const auto& g : opt.at("groups")) {
      std::vector<at::Tensor> ps;
      for (size_t k = 0; k < g.at("shapes").size(); ++k) {
        ps.push_back(
            tensor_of(g.at("init")[k], g.at("shapes")[k].get<std::vector<std::int64_t>>(), dtype_named(g.at("dtype")))
                .requires_grad_());
      }
      all.insert(all.end(), ps.begin(), ps.end());
      groups.emplace_back(ps, std::make_unique<torch::optim::SGDOptions>(g.at("lr").get<double>()));
    }
    out.params.push_back(all);
    out.sgd.push_back(std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(0.1)));
  }
  return out;
}

}  // namespace

TEST(GradScalerVsPython, SameScalesSkipsUnscaledGradientsAndParameters) {
  const json reference = load_reference("grad_scaler.json");
  ASSERT_FALSE(reference.at("scenarios").empty());
  for (const auto& scenario : reference.at("scenarios")) {
    SCOPED_TRACE("scenario " + scenario.at("name").get<std::string>());
    Optimizers opts = build(scenario.at("optimizers"));
    GradScaler scaler(options_from(scenario.at("options")));
    int t = 0;
    for (const auto& step : scenario.at("steps")) {
      SCOPED_TRACE("step " + std::to_string(t++));
      const at::Tensor scaled_loss = scaler.scale(at::tensor(1.5f));
      EXPECT_EQ(scaled_loss.item<double>(), step.at("scaled_loss").get<double>());
      EXPECT_EQ(scaler.get_scale(), step.at("scale_before").get<double>());
      for (size_t o = 0; o < opts.params.size(); ++o) {
        for (size_t k = 0; k < opts.params[o].size(); ++k) {
          const at::Tensor& p = opts.params[o][k];
          p.mutable_grad() = tensor_of(step.at("grads")[o][k], p.sizes().vec(), p.scalar_type());
        }
      }
      if (step.at("explicit_unscale").get<bool>()) {
        for (auto& opt : opts.sgd) scaler.unscale_(*opt);
      }
      for (size_t o = 0; o < opts.sgd.size(); ++o) {
        EXPECT_EQ(scaler.step(*opts.sgd[o]), step.at("stepped")[o].get<bool>()) << "optimizer " << o;
        for (size_t k = 0; k < opts.params[o].size(); ++k) {
          EXPECT_TRUE(same_values(opts.params[o][k].grad(), step.at("unscaled")[o][k])) << "grad " << o << "." << k;
        }
      }
      if (step.at("new_scale").is_null()) {
        scaler.update();
      } else {
        scaler.update(step.at("new_scale").get<double>());
      }
      for (size_t o = 0; o < opts.params.size(); ++o) {
        for (size_t k = 0; k < opts.params[o].size(); ++k) {
          EXPECT_TRUE(same_values(opts.params[o][k], step.at("params_after")[o][k])) << "param " << o << "." << k;
        }
      }
      EXPECT_EQ(scaler.get_scale(), step.at("scale_after").get<double>());
      EXPECT_EQ(scaler.growth_tracker(), step.at("growth_tracker_after").get<std::int64_t>());
      EXPECT_EQ(*scaler.state_dict(), dtrain::amp::grad_scaler_state_from_json(step.at("state_dict").dump()));
    }
  }
}

TEST(GradScaler, DefaultsArePythons) {
  GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.options().growth_factor, 2.0);
  EXPECT_EQ(scaler.options().backoff_factor, 0.5);
  EXPECT_EQ(scaler.options().growth_interval, 2000);
  EXPECT_TRUE(scaler.is_enabled());
}

TEST(GradScaler, StateSurvivesJsonAndResumesTheSameSequence) {
  auto run = [](GradScaler& scaler, at::Tensor& w, torch::optim::SGD& opt, int from, int to) {
    std::vector<double> scales;
    for (int t = from; t < to; ++t) {
      opt.zero_grad();
      scaler.scale((w * (t % 3 == 2 ? INFINITY : 1.0f)).sum()).backward();
      scaler.step(opt);
      scaler.update();
      scales.push_back(scaler.get_scale());
    }
    return scales;
  };
  const GradScalerOptions options{.init_scale = 4.0, .growth_interval = 2};
  at::Tensor w1 = at::ones({3}).requires_grad_();
  torch::optim::SGD opt1({w1}, 0.1);
  GradScaler straight(options);
  const auto all = run(straight, w1, opt1, 0, 8);

  at::Tensor w2 = at::ones({3}).requires_grad_();
  torch::optim::SGD opt2({w2}, 0.1);
  GradScaler first(options);
  auto resumed = run(first, w2, opt2, 0, 4);
  const std::string saved = dtrain::amp::to_json(*first.state_dict());
  GradScaler second(GradScalerOptions{});  // other options: the state replaces them
  second.load_state_dict(dtrain::amp::grad_scaler_state_from_json(saved));
  EXPECT_EQ(second.get_scale(), first.get_scale());
  const auto rest = run(second, w2, opt2, 4, 8);
  resumed.insert(resumed.end(), rest.begin(), rest.end());
  EXPECT_EQ(resumed, all);
  EXPECT_TRUE(at::equal(w1, w2));
}

TEST(GradScaler, DisabledPassesThrough) {
  GradScaler scaler({.enabled = false});
  at::Tensor w = at::ones({2}).requires_grad_();
  torch::optim::SGD opt({w}, 1.0);
  const at::Tensor loss = (w * 3).sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  w.mutable_grad().fill_(INFINITY);
  scaler.unscale_(opt);
  EXPECT_TRUE(scaler.step(opt));  // no inf check when disabled, as in Python
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_FALSE(scaler.state_dict().has_value());
}

TEST(GradScaler, MisuseIsAnErrorWithAHint) {
  EXPECT_THROW(GradScaler({.growth_factor = 1.0}), dtrain::ConfigError);
  EXPECT_THROW(GradScaler({.backoff_factor = 1.0}), dtrain::ConfigError);
  at::Tensor w = at::ones({2}).requires_grad_();
  torch::optim::SGD opt({w}, 1.0);
  GradScaler scaler;
  try {
    scaler.step(opt);
    FAIL() << "step before scale";
  } catch (const dtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("before any scale()"), std::string::npos) << e.what();
    EXPECT_FALSE(e.hint().empty());
  }
  EXPECT_THROW(scaler.update(), dtrain::ConfigError);
  scaler.scale(w.sum()).backward();
  EXPECT_THROW(scaler.update(), dtrain::ConfigError);  // nothing checked yet
  scaler.unscale_(opt);
  EXPECT_THROW(scaler.unscale_(opt), dtrain::ConfigError);
  scaler.step(opt);
  EXPECT_THROW(scaler.step(opt), dtrain::ConfigError);
  EXPECT_THROW(scaler.unscale_(opt), dtrain::ConfigError);
  scaler.update();
  w.mutable_grad() = at::ones({2}, at::kHalf);
  EXPECT_THROW(scaler.unscale_(opt), dtrain::ConfigError);
  w.mutable_grad() = at::Tensor();
  EXPECT_THROW(scaler.step(opt), dtrain::ConfigError);  // no gradient at all
  EXPECT_THROW(dtrain::amp::grad_scaler_state_from_json("{\"scale\": 2}"), dtrain::ConfigError);
}
