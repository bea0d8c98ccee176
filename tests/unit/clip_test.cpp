// Global-norm clipping in one process against torch::nn::utils::clip_grad_norm_
// (norms 1, 2, 3.5, inf; clipping and not), and its edge cases. The sharded
// case is in tests/multirank/amp_test.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>

#include <limits>
#include <vector>

#include "dtrain/dist/clip.h"
#include "dtrain/error.h"

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Parameters of assorted shapes (one a scalar) with gradients, and one without.
std::vector<at::Tensor> params_with_grads(std::uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{7}, {3, 5}, {}, {2, 2, 2}}) {
    at::Tensor p = at::randn(shape, g).requires_grad_();
    p.mutable_grad() = at::randn(shape, g) * 3;
    params.push_back(p);
  }
  at::Tensor no_grad = at::randn({4}, g).requires_grad_();  // skipped
  params.push_back(no_grad);
  return params;
}

std::vector<at::Tensor> grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return out;
}

}  // namespace

TEST(ClipGradNorm, EqualsTorchClipGradNorm) {
  for (const double p : {1.0, 2.0, 3.5, kInf}) {
    for (const double max_norm : {0.5, 1e6}) {  // clipping, and not
      SCOPED_TRACE("p=" + std::to_string(p) + " max_norm=" + std::to_string(max_norm));
      auto ours = params_with_grads(1), theirs = params_with_grads(1);
      const double expected = torch::nn::utils::clip_grad_norm_(theirs, max_norm, p);
      const at::Tensor norm = dtrain::clip_grad_norm_(ours, max_norm, {.norm_type = p});
      EXPECT_NEAR(norm.item<double>(), expected, 1e-6 * expected);
      const auto a = grads(ours), b = grads(theirs);
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(a[i].defined(), b[i].defined());
        if (a[i].defined()) {
          EXPECT_TRUE(at::allclose(a[i], b[i], 1e-6, 1e-7)) << "grad " << i;
        }
      }
      if (max_norm < expected) {
        EXPECT_NEAR(dtrain::grad_norm(dtrain::GradientSet::replicated(ours), {.norm_type = p}).item<double>(), max_norm,
                    1e-5);
      }
    }
  }
}

TEST(ClipGradNorm, EmptyGradientsAddNothing) {
  auto params = params_with_grads(4);
  const double expected =
      dtrain::grad_norm(dtrain::GradientSet::replicated(params), {.norm_type = kInf}).item<double>();
  at::Tensor empty = at::ones({0}).requires_grad_();
  empty.mutable_grad() = at::ones({0});
  params.push_back(empty);
  EXPECT_EQ(dtrain::grad_norm(dtrain::GradientSet::replicated(params), {.norm_type = kInf}).item<double>(), expected);
}

TEST(ClipGradNorm, NoGradientsGiveZero) {
  std::vector<at::Tensor> params{at::ones({3}).requires_grad_()};
  EXPECT_EQ(dtrain::clip_grad_norm_(params, 1.0).item<double>(), 0.0);
  EXPECT_EQ(dtrain::clip_grad_norm_(std::vector<at::Tensor>{}, 1.0).item<double>(), 0.0);
}

TEST(ClipGradNorm, NonFiniteNormIsAnErrorOnlyWhenAsked) {
  auto params = params_with_grads(2);
  params[1].mutable_grad()[0][0] = INFINITY;
  EXPECT_THROW(dtrain::clip_grad_norm_(params, 1.0, {.error_if_nonfinite = true}), dtrain::Error);
  EXPECT_TRUE(std::isinf(dtrain::clip_grad_norm_(params, 1.0).item<double>()));
  params[0].mutable_grad()[0] = NAN;
  EXPECT_THROW(dtrain::clip_grad_norm_(params, 1.0, {.norm_type = kInf, .error_if_nonfinite = true}), dtrain::Error);
}

TEST(ClipGradNorm, BadNormTypeIsAConfigError) {
  auto params = params_with_grads(3);
  EXPECT_THROW(dtrain::clip_grad_norm_(params, 1.0, {.norm_type = 0.0}), dtrain::ConfigError);
  EXPECT_THROW(dtrain::clip_grad_norm_(params, 1.0, {.norm_type = -2.0}), dtrain::ConfigError);
}
