// Autocast: the dtype of each op's output under dtrain::amp::Autocast equals
// the one Python records under torch.autocast("cpu", torch.bfloat16)
// (tests/data/amp/gen_autocast.py -> autocast_dtypes.json); nesting and exit
// restore the state; leaving the outermost region drops the weight cache.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/normalization.h>

#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "dtrain/amp/autocast.h"
#include "dtrain/error.h"
#include "test_paths.h"

using dtrain::amp::Autocast;
namespace F = torch::nn::functional;

namespace {

std::string python_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    default: return c10::toString(t);
  }
}

// The inputs of gen_autocast.py, by name (values differ; shapes and dtypes match).
std::map<std::string, at::Tensor> inputs() {
  auto g = at::make_generator<at::CPUGeneratorImpl>(0);
  auto r = [&](at::IntArrayRef shape) { return at::randn(shape, g); };
  return {{"x", r({4, 8})},
          {"w1", r({16, 8})},
          {"b1", r({16})},
          {"w2", r({5, 16})},
          {"b2", r({5})},
          {"img", r({2, 3, 8, 8})},
          {"kernel", r({4, 3, 3, 3})},
          {"a3", r({2, 4, 6})},
          {"b3", r({2, 6, 3})},
          {"c3", r({2, 4, 3})},
          {"m", r({4, 6})},
          {"n", r({6, 3})},
          {"c", r({4, 3})},
          {"y", at::tensor({0, 1, 4, 2}, at::kLong)},
          {"target", r({4, 5})},
          {"probs", at::rand({4, 5}, g)},
          {"ids", at::tensor({1, 2, 0, 3}, at::kLong).reshape({2, 2})},
          {"table", r({5, 8})},
          {"sq", r({6, 6}) + 6 * at::eye(6)}};
}

using Recorded = std::vector<std::pair<std::string, at::Tensor>>;

Recorded model(std::map<std::string, at::Tensor>& t) {
  Recorded out;
  at::Tensor h = F::linear(t["x"], t["w1"], t["b1"]);
  out.emplace_back("linear1", h);
  h = at::relu(h);
  out.emplace_back("relu", h);
  h = at::layer_norm(h, {16});
  out.emplace_back("layer_norm", h);
  h = at::gelu(h);
  out.emplace_back("gelu", h);
  const at::Tensor logits = F::linear(h, t["w2"], t["b2"]);
  out.emplace_back("linear2", logits);
  out.emplace_back("log_softmax", at::log_softmax(logits, 1));
  out.emplace_back("cross_entropy", F::cross_entropy(logits, t["y"]));
  out.emplace_back("mse_loss", F::mse_loss(logits, t["target"]));
  out.emplace_back("residual_add", logits + t["target"]);
  return out;
}

Recorded ops(std::map<std::string, at::Tensor>& t) {
  auto mm = [&] { return at::mm(t["m"], t["n"]); };
  return {
      {"mm", mm()},
      {"matmul", at::matmul(t["a3"], t["b3"])},
      {"bmm", at::bmm(t["a3"], t["b3"])},
      {"addmm", at::addmm(t["c"], t["m"], t["n"])},
      {"baddbmm", at::baddbmm(t["c3"], t["a3"], t["b3"])},
      {"conv2d", at::conv2d(t["img"], t["kernel"], {}, 1, 1)},
      {"max_pool2d", at::max_pool2d(at::conv2d(t["img"], t["kernel"]), {2})},
      {"batch_norm_eval", at::batch_norm(t["img"], {}, {}, at::zeros({3}), at::ones({3}), false, 0.1, 1e-5, false)},
      {"softmax", at::softmax(t["x"], 1)},
      {"sum", t["x"].sum()},
      {"exp", at::exp(t["x"])},
      {"tanh", at::tanh(t["x"])},
      {"prod", at::prod(t["x"])},
      {"cdist", at::cdist(t["m"], t["m"])},
      {"binary_cross_entropy", F::binary_cross_entropy(t["probs"], t["probs"].round())},
      {"nll_loss", F::nll_loss(at::log_softmax(t["target"], 1), t["y"])},
      {"l1_loss", F::l1_loss(t["x"], t["x"] * 2)},
      {"smooth_l1_loss", F::smooth_l1_loss(t["x"], t["x"] * 2)},
      {"kl_div", F::kl_div(t["target"], t["probs"], F::KLDivFuncOptions().reduction(torch::kBatchMean))},
      {"embedding", at::embedding(t["table"], t["ids"])},
      {"inverse", at::inverse(t["sq"])},
      {"cat_mixed", at::cat({mm(), t["c"]})},
      {"stack_mixed", at::stack({mm(), t["c"]})},
      {"linear_bf16_plus_fp32", F::linear(t["x"], t["w1"]) + t["b1"]},
      {"softmax_of_bf16", at::softmax(mm(), 1)},
      {"sum_of_bf16", mm().sum()},
      {"exp_of_bf16", at::exp(mm())},
      {"prod_of_bf16", at::prod(mm())},
      {"cdist_of_bf16", at::cdist(mm(), t["c"])},
      {"l1_loss_of_bf16", F::l1_loss(mm(), t["c"])},
      {"mse_loss_of_bf16", F::mse_loss(mm(), t["c"])},
      {"add_bf16_bf16", mm() + mm()},
  };
}

void expect_same_dtypes(const Recorded& ours, const nlohmann::json& python) {
  ASSERT_EQ(ours.size(), python.size()) << "the op lists of the test and gen_autocast.py differ";
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_EQ(ours[i].first, python[i][0].get<std::string>()) << "op " << i;
    EXPECT_EQ(python_name(ours[i].second.scalar_type()), python[i][1].get<std::string>()) << ours[i].first;
  }
}

}  // namespace

TEST(AutocastVsPython, OutputDtypesMatchTorchAutocastCpuBf16) {
  std::ifstream in(dtrain::testing::source_dir() + "/tests/data/amp/autocast_dtypes.json");
  ASSERT_TRUE(in.good());
  const auto python = nlohmann::json::parse(in);
  auto t = inputs();
  Recorded model_out, ops_out;
  {
    Autocast autocast(c10::kCPU, {.dtype = at::kBFloat16});
    model_out = model(t);
    ops_out = ops(t);
  }
  expect_same_dtypes(model_out, python.at("model"));
  expect_same_dtypes(ops_out, python.at("ops"));

  // Gradients of fp32 leaves stay fp32 when backward runs after the region.
  at::Tensor w = t["w1"].clone().requires_grad_();
  at::Tensor loss;
  {
    Autocast autocast(c10::kCPU);
    loss = F::linear(t["x"], w).to(at::kFloat).sum();
  }
  loss.backward();
  EXPECT_EQ(python_name(w.grad().scalar_type()), python.at("leaf_grad").get<std::string>());
}

TEST(Autocast, NestingAndExitRestoreTheState) {
  const at::Tensor x = at::randn({2, 4}), w = at::randn({3, 4});
  ASSERT_FALSE(dtrain::amp::is_autocast_enabled(c10::kCPU));
  const c10::ScalarType initial_dtype = dtrain::amp::autocast_dtype(c10::kCPU);
  EXPECT_EQ(initial_dtype, at::kBFloat16);
  {
    Autocast outer(c10::kCPU);
    EXPECT_TRUE(dtrain::amp::is_autocast_enabled(c10::kCPU));
    EXPECT_EQ(F::linear(x, w).scalar_type(), at::kBFloat16);
    {
      Autocast off(c10::kCPU, {.enabled = false});
      EXPECT_FALSE(dtrain::amp::is_autocast_enabled(c10::kCPU));
      EXPECT_EQ(F::linear(x, w).scalar_type(), at::kFloat);
      {
        Autocast half(c10::kCPU, {.dtype = at::kHalf, .cache_enabled = false});
        EXPECT_EQ(F::linear(x, w).scalar_type(), at::kHalf);
        EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
      }
      EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
      EXPECT_EQ(dtrain::amp::autocast_dtype(c10::kCPU), at::kBFloat16);
      EXPECT_FALSE(dtrain::amp::is_autocast_enabled(c10::kCPU));
    }
    EXPECT_TRUE(dtrain::amp::is_autocast_enabled(c10::kCPU));
    EXPECT_EQ(F::linear(x, w).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(dtrain::amp::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(dtrain::amp::autocast_dtype(c10::kCPU), initial_dtype);
  EXPECT_EQ(F::linear(x, w).scalar_type(), at::kFloat);

  // An exception leaving the region restores the state too.
  try {
    Autocast autocast(c10::kCPU);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(dtrain::amp::is_autocast_enabled(c10::kCPU));
}

TEST(Autocast, OutermostExitClearsTheWeightCache) {
  // Within a region, the bf16 copy of a weight (an fp32 leaf requiring grad)
  // is cast once and reused, so an in-place update made inside the region is
  // not seen; the next region must cast again and see it. (at::linear: LibTorch's
  // F::linear multiplies by weight.t(), a view, which autocast never caches.)
  const at::Tensor x = at::ones({1, 4});
  at::Tensor w = at::ones({2, 4}).requires_grad_();
  auto bump = [&] {
    at::NoGradGuard no_grad;
    w.add_(1.0);
  };
  at::Tensor before, cached, after;
  {
    Autocast outer(c10::kCPU);
    before = at::linear(x, w);
    { Autocast inner(c10::kCPU); }  // an inner exit must not clear the outer region's cache
    bump();
    cached = at::linear(x, w);
  }
  {
    Autocast again(c10::kCPU);
    after = at::linear(x, w);
  }
  EXPECT_TRUE(at::equal(cached, before)) << "the cache was not used (or was cleared by the inner exit)";
  EXPECT_EQ(after[0][0].item<float>(), 8.0f) << "the outer exit did not clear the cache";
}

TEST(Autocast, UnsupportedRequestsAreErrors) {
  auto enter = [](c10::DeviceType device_type, const dtrain::amp::AutocastOptions& options) {
    Autocast autocast(device_type, options);
  };
  EXPECT_THROW(enter(c10::kCPU, {.dtype = at::kFloat}), dtrain::ConfigError);
  EXPECT_THROW(enter(c10::kCPU, {.dtype = at::kDouble}), dtrain::ConfigError);
  EXPECT_NO_THROW(enter(c10::kCPU, {.dtype = at::kFloat, .enabled = false}));
  if (!at::hasCUDA()) {
    EXPECT_THROW(enter(c10::kCUDA, {}), dtrain::DeviceError);
  }
  EXPECT_FALSE(dtrain::amp::is_autocast_enabled(c10::kCPU));
}
