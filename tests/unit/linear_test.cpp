// dtrain::nn::linear against at::linear, the reference: the same outputs and
// gradients (fp32 rounding apart: oneDNN sums in another order) for 2-D and
// 3-D inputs, with and without bias, for transposed operands, when autograd
// asks for one gradient at a time (the zero-bubble split), and for second
// derivatives; at::linear itself where oneDNN does not apply.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <vector>

#include "dtrain/amp/autocast.h"
#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "dtrain/nn/linear.h"

namespace dnn = dtrain::nn;  // qualified calls: ADL would also find at::linear
using dnn::linear_uses_onednn;

namespace {

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const char* what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::allclose(actual, expected, 1e-5, 1e-6))
      << what << ": max abs difference " << (actual - expected).abs().max().item<double>();
}

struct Operands {
  at::Tensor x, weight, bias;
};

// Leaf copies of `o` that require gradients (bias only if defined).
Operands leaves(const Operands& o) {
  Operands copy{o.x.detach().clone().requires_grad_(), o.weight.detach().clone().requires_grad_(), {}};
  if (o.bias.defined()) copy.bias = o.bias.detach().clone().requires_grad_();
  return copy;
}

// GTEST_SKIP returns from the function it is in: a macro, so that it ends the
// test. ctest runs these tests twice: as unit.Linear.* with the process's
// choice (on an Intel CPU at::linear, so they skip) and as
// unit.onednn.Linear.* with DTRAIN_LINEAR_KERNEL=onednn (tests/CMakeLists.txt).
#define DTRAIN_SKIP_WITHOUT_ONEDNN()                                                                           \
  if (!dtrain::nn::onednn_linear_enabled())                                                                    \
  GTEST_SKIP() << "linear() does not take oneDNN here (no oneDNN, a CPU its fp32 path refuses, or the kernel " \
                  "chosen for this CPU is at::linear: DTRAIN_LINEAR_KERNEL=onednn takes it)"

}  // namespace

TEST(Linear, MatchesAtLinearForwardAndBackward) {
  DTRAIN_SKIP_WITHOUT_ONEDNN();
  at::manual_seed(0);
  const std::vector<Operands> cases = {
      {at::randn({6, 7}), at::randn({3, 7}), {}},
      {at::randn({2, 5, 7}), at::randn({3, 7}), at::randn({3})},
      {at::randn({4, 2, 5, 33}), at::randn({65, 33}), {}},
      {at::randn({7, 6}).t(), at::randn({7, 3}).t(), {}},              // column-major x and weight
      {at::randn({6, 14}).slice(1, 0, 14, 2), at::randn({3, 7}), {}},  // neither rows nor columns contiguous
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    auto ours = leaves(cases[i]);
    auto ref = leaves(cases[i]);
    EXPECT_TRUE(linear_uses_onednn(ours.x, ours.weight, ours.bias));
    const at::Tensor y = dnn::linear(ours.x, ours.weight, ours.bias);
    const at::Tensor y_ref = at::linear(ref.x, ref.weight, ref.bias);
    expect_close(y, y_ref, "output");
    const at::Tensor dy = at::randn(y.sizes());
    y.backward(dy);
    y_ref.backward(dy);
    expect_close(ours.x.grad(), ref.x.grad(), "dx");
    expect_close(ours.weight.grad(), ref.weight.grad(), "dweight");
    if (ours.bias.defined()) expect_close(ours.bias.grad(), ref.bias.grad(), "dbias");
  }
}

// The zero-bubble schedule asks autograd for the input gradient first and the
// weight gradient later, each from the retained graph.
TEST(Linear, GivesEachRequestedGradientAlone) {
  DTRAIN_SKIP_WITHOUT_ONEDNN();
  at::manual_seed(1);
  const Operands base{at::randn({3, 4, 16}), at::randn({24, 16}), {}};
  auto ours = leaves(base);
  auto ref = leaves(base);
  const at::Tensor y = dnn::linear(ours.x, ours.weight).tanh().sum();
  const at::Tensor y_ref = at::linear(ref.x, ref.weight).tanh().sum();
  const auto dx = torch::autograd::grad({y}, {ours.x}, {}, /*retain_graph=*/true);
  const auto dx_ref = torch::autograd::grad({y_ref}, {ref.x}, {}, /*retain_graph=*/true);
  expect_close(dx[0], dx_ref[0], "dx alone");
  const auto dw = torch::autograd::grad({y}, {ours.weight});
  const auto dw_ref = torch::autograd::grad({y_ref}, {ref.weight});
  expect_close(dw[0], dw_ref[0], "dweight alone");
  EXPECT_FALSE(ours.x.grad().defined());
  EXPECT_FALSE(ours.weight.grad().defined());
}

// With create_graph the backward is differentiable: a gradient penalty's
// gradient equals at::linear's.
TEST(Linear, SecondDerivativesMatchAtLinear) {
  DTRAIN_SKIP_WITHOUT_ONEDNN();
  at::manual_seed(2);
  const Operands base{at::randn({5, 8}), at::randn({6, 8}), at::randn({6})};
  auto ours = leaves(base);
  auto ref = leaves(base);
  auto penalty = [](const at::Tensor& y, const at::Tensor& x) {
    const auto g = torch::autograd::grad({y.pow(3).sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    return g[0].pow(2).sum();
  };
  penalty(dnn::linear(ours.x, ours.weight, ours.bias), ours.x).backward();
  penalty(at::linear(ref.x, ref.weight, ref.bias), ref.x).backward();
  expect_close(ours.x.grad(), ref.x.grad(), "d/dx of the penalty");
  expect_close(ours.weight.grad(), ref.weight.grad(), "d/dweight of the penalty");
  expect_close(ours.bias.grad(), ref.bias.grad(), "d/dbias of the penalty");
}

// Outside dense fp32 CPU tensors, and under CPU autocast, dnn::linear() is
// at::linear: same bits, same dtype rules.
TEST(Linear, IsAtLinearWhereOneDnnDoesNotApply) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({4, 5}, at::kDouble), w = at::randn({3, 5}, at::kDouble);
  EXPECT_FALSE(linear_uses_onednn(x, w));
  EXPECT_TRUE(at::equal(dnn::linear(x, w), at::linear(x, w)));

  const at::Tensor xf = x.to(at::kFloat), wf = w.to(at::kFloat);
  dtrain::amp::Autocast autocast(at::kCPU);
  EXPECT_FALSE(linear_uses_onednn(xf, wf));
  const at::Tensor y = dnn::linear(xf, wf);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(y, at::linear(xf, wf)));
}

// Where oneDNN's matmul does not run (probed), linear() is at::linear and
// onednn_mm() says so; where it runs, the probe agrees with a real product.
// linear() takes it exactly where the kernel switch says.
TEST(Linear, ProbeDecidesThePath) {
  const at::Tensor x = at::randn({4, 5}), w = at::randn({3, 5});
  EXPECT_EQ(linear_uses_onednn(x, w), dtrain::nn::onednn_linear_enabled());
  if (dtrain::nn::onednn_matmul_available()) {
    EXPECT_TRUE(at::allclose(dtrain::nn::onednn_mm(x, w.t()), at::mm(x, w.t()), 1e-5, 1e-6));
  } else {
    EXPECT_FALSE(dtrain::nn::onednn_linear_enabled());
    EXPECT_TRUE(at::equal(dnn::linear(x, w), at::linear(x, w)));
    EXPECT_THROW(dtrain::nn::onednn_mm(x, w.t()), dtrain::ConfigError);
  }
}

// Note [Kernel by CPU vendor]: "auto" takes oneDNN on x86 CPUs other than
// Intel's; the switch decides as DTRAIN_LINEAR_KERNEL says.
TEST(Linear, KernelFollowsTheSwitchAndTheCpuVendor) {
  EXPECT_TRUE(dtrain::nn::onednn_preferred_for("AuthenticAMD"));
  EXPECT_TRUE(dtrain::nn::onednn_preferred_for("HygonGenuine"));
  EXPECT_FALSE(dtrain::nn::onednn_preferred_for("GenuineIntel"));
  EXPECT_FALSE(dtrain::nn::onednn_preferred_for(""));
#if defined(__x86_64__)
  EXPECT_EQ(dtrain::nn::cpu_vendor().size(), 12u) << dtrain::nn::cpu_vendor();
#endif
  const bool available = dtrain::nn::onednn_matmul_available();
  bool expected = false;
  switch (dtrain::dist::linear_kernel()) {
    case dtrain::dist::LinearKernel::kAten: expected = false; break;
    case dtrain::dist::LinearKernel::kOneDnn: expected = available; break;
    case dtrain::dist::LinearKernel::kAuto:
      expected = available && dtrain::nn::onednn_preferred_for(dtrain::nn::cpu_vendor());
      break;
  }
  EXPECT_EQ(dtrain::nn::onednn_linear_enabled(), expected) << "vendor " << dtrain::nn::cpu_vendor();
  EXPECT_STREQ(dtrain::nn::linear_kernel_name(), expected ? "onednn" : "aten");
}

TEST(OnednnMm, RejectsWhatItCannotMultiply) {
  DTRAIN_SKIP_WITHOUT_ONEDNN();
  EXPECT_THROW(dtrain::nn::onednn_mm(at::randn({2, 3}), at::randn({4, 5})), dtrain::ConfigError);
  EXPECT_THROW(dtrain::nn::onednn_mm(at::randn({2, 3}, at::kDouble), at::randn({3, 5}, at::kDouble)),
               dtrain::ConfigError);
  const at::Tensor a = at::randn({9, 17}), b = at::randn({17, 5});
  EXPECT_TRUE(at::allclose(dtrain::nn::onednn_mm(a, b), at::mm(a, b), 1e-5, 1e-6));
}
