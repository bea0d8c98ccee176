// dtrain::nn::gelu against at::gelu, the reference: the same outputs and
// input gradients (fp32 rounding apart) for both forms, for sizes around the
// vector width and large odd ones, for any strides; at least as accurate as
// ATen's against fp64; the same bits on one thread and on several; at::gelu
// itself where the fused path does not apply. ctest runs these tests once
// more per instruction set ATen has here (ATEN_CPU_CAPABILITY=avx2, default:
// tests/CMakeLists.txt), so each compiled kernel is tested.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <string>
#include <vector>

#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "dtrain/nn/gelu.h"

namespace dnn = dtrain::nn;  // qualified calls: ADL would also find at::gelu

namespace {

const std::vector<std::string> kForms = {"none", "tanh"};

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::allclose(actual, expected, 1e-5, 1e-6))
      << what << ": max abs difference " << (actual - expected).abs().max().item<double>();
}

double max_abs_error(const at::Tensor& actual, const at::Tensor& exact) {
  return (actual.to(at::kDouble) - exact).abs().max().item<double>();
}

// GTEST_SKIP returns from the function it is in: a macro, so that it ends the test.
#define DTRAIN_SKIP_WITHOUT_FUSED_GELU()                                             \
  if (dtrain::dist::linear_kernel() == dtrain::dist::LinearKernel::kAten)            \
  GTEST_SKIP() << "DTRAIN_LINEAR_KERNEL=aten: dtrain::nn::gelu is at::gelu (tested " \
                  "by Gelu.IsAtGeluWhereTheFusedPathDoesNotApply)"

// x's output and its gradient for dy, through f.
template <typename F>
std::pair<at::Tensor, at::Tensor> output_and_gradient(F&& f, const at::Tensor& x, const at::Tensor& dy) {
  const at::Tensor leaf = x.detach().clone().requires_grad_();
  const at::Tensor y = f(leaf);
  y.backward(dy);
  return {y.detach(), leaf.grad()};
}

}  // namespace

TEST(Gelu, MatchesAtGeluForwardAndBackward) {
  DTRAIN_SKIP_WITHOUT_FUSED_GELU();
  at::manual_seed(0);
  // Around the vector widths (8 and 16 floats), odd large sizes (the tail and
  // several parallel chunks), the GPT's hidden activation, and a transposed
  // (non-contiguous) input. Values of a pre-activation's scale: further out,
  // ATen's own fp32 erf errs by more than 1e-6 (the next test compares both
  // with fp64 there).
  std::vector<at::Tensor> inputs;
  for (std::int64_t n : {1, 7, 8, 9, 15, 16, 17, 33, 100'003}) inputs.push_back(at::randn({n}));
  inputs.push_back(at::randn({12, 64, 512}));
  inputs.push_back(at::randn({40, 24}).t());
  for (const auto& form : kForms) {
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const std::string what = form + ", input " + std::to_string(i);
      const at::Tensor& x = inputs[i];
      EXPECT_TRUE(dnn::gelu_uses_fused_kernel(x)) << what;
      const at::Tensor dy = at::randn(x.sizes());
      const auto [y, dx] = output_and_gradient([&](const at::Tensor& t) { return dnn::gelu(t, form); }, x, dy);
      const auto [y_ref, dx_ref] = output_and_gradient([&](const at::Tensor& t) { return at::gelu(t, form); }, x, dy);
      expect_close(y, y_ref, what + ": output");
      expect_close(dx, dx_ref, what + ": dx");
    }
  }
}

// Against GELU in fp64, the fused kernel's output and derivative are no
// further off than ATen's own fp32 GELU (measured on AMD EPYC family 25, AVX-512:
// output 4.7e-7 against ATen's 1.2e-6, derivative 2.8e-7 against 2.8e-7).
TEST(Gelu, IsAsAccurateAsAtGeluAgainstFp64) {
  DTRAIN_SKIP_WITHOUT_FUSED_GELU();
  at::manual_seed(1);
  const at::Tensor x = at::randn({200'001}) * 4;
  const at::Tensor ones = at::ones_like(x);
  const at::Tensor x64 = x.to(at::kDouble);
  for (const auto& form : kForms) {
    const auto [y, d] = output_and_gradient([&](const at::Tensor& t) { return dnn::gelu(t, form); }, x, ones);
    const at::Tensor y_exact = at::gelu(x64, form);
    const at::Tensor d_exact = at::gelu_backward(at::ones_like(x64), x64, form);
    const double y_aten = max_abs_error(at::gelu(x, form), y_exact);
    const double d_aten = max_abs_error(at::gelu_backward(ones, x, form), d_exact);
    // A float's rounding at the largest |value| (~17) is 9.5e-7: one rounding step of slack.
    EXPECT_LE(max_abs_error(y, y_exact), y_aten + 1e-6) << form;
    EXPECT_LE(max_abs_error(d, d_exact), d_aten + 1e-6) << form;
  }
}

// Element-wise work split over threads gives every element the same
// operations: several threads and one give the same bits.
TEST(Gelu, SameBitsOnOneThreadAndOnSeveral) {
  DTRAIN_SKIP_WITHOUT_FUSED_GELU();
  at::manual_seed(2);
  const at::Tensor x = at::randn({300'007});
  const at::Tensor dy = at::randn(x.sizes());
  const int threads = at::get_num_threads();
  auto run = [&](int n) {
    at::set_num_threads(n);
    return output_and_gradient([](const at::Tensor& t) { return dnn::gelu(t); }, x, dy);
  };
  const auto one = run(1);
  const auto several = run(4);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one.first, several.first));
  EXPECT_TRUE(at::equal(one.second, several.second));
}

// Its backward keeps the derivative, not the input: a second derivative is
// refused with a hint rather than computed wrong.
TEST(Gelu, RefusesSecondDerivatives) {
  DTRAIN_SKIP_WITHOUT_FUSED_GELU();
  const at::Tensor x = at::randn({5}).requires_grad_();
  const at::Tensor y = dnn::gelu(x).sum();
  EXPECT_THROW(torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true), dtrain::ConfigError);
}

// Without a gradient wanted (evaluation, a recompute's first pass) the
// output has the training forward's bits, the tail included.
TEST(Gelu, NoGradOutputHasTheTrainingForwardsBits) {
  DTRAIN_SKIP_WITHOUT_FUSED_GELU();
  at::manual_seed(4);
  for (const auto& form : kForms) {
    const at::Tensor x = at::randn({3, 1001});
    const at::Tensor trained = dnn::gelu(x.detach().requires_grad_(), form);
    EXPECT_TRUE(trained.requires_grad()) << form;
    EXPECT_TRUE(at::equal(dnn::gelu(x, form), trained.detach())) << form << ": x not requiring grad";
    at::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(dnn::gelu(x.detach().requires_grad_(), form), trained.detach())) << form << ": no_grad";
  }
}

// Where the fused path does not apply (another dtype, an empty tensor,
// DTRAIN_LINEAR_KERNEL=aten) gelu() is at::gelu: same bits, and a double's
// second derivative works.
TEST(Gelu, IsAtGeluWhereTheFusedPathDoesNotApply) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({4, 37});
  const bool aten = dtrain::dist::linear_kernel() == dtrain::dist::LinearKernel::kAten;
  EXPECT_EQ(dnn::gelu_uses_fused_kernel(x), !aten);
  EXPECT_FALSE(dnn::gelu_uses_fused_kernel(at::randn({0})));
  for (const auto& form : kForms) {
    if (aten) {
      EXPECT_TRUE(at::equal(dnn::gelu(x, form), at::gelu(x, form)));
    }
    const at::Tensor xd = x.to(at::kDouble).requires_grad_();
    EXPECT_FALSE(dnn::gelu_uses_fused_kernel(xd));
    const auto g = torch::autograd::grad({dnn::gelu(xd, form).pow(3).sum()}, {xd}, {}, true, true);
    const auto g_ref = torch::autograd::grad({at::gelu(xd, form).pow(3).sum()}, {xd}, {}, true, true);
    EXPECT_TRUE(at::equal(g[0], g_ref[0]));
  }
  EXPECT_EQ(dnn::gelu(at::randn({0}).requires_grad_()).numel(), 0);
  EXPECT_THROW(dnn::gelu(x, "erf"), dtrain::ConfigError);
}
