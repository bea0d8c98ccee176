// dtrain::nn::causal_attention against at::scaled_dot_product_attention
// (is_causal), the reference: the same outputs (within at::allclose's 1e-5,
// 1e-6, as nn::linear's) and gradients as accurate as ATen's against fp64
// attention (oneDNN sums in another order, and the softmax is taken over
// whole rows) for single and several heads, sequences of 1 up to the longest the
// path takes, views out of a fused qkv product, one gradient at a time, and
// second derivatives; ATen's own kernel where the oneDNN path does not apply.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <optional>
#include <vector>

#include "dtrain/amp/autocast.h"
#include "dtrain/nn/attention.h"
#include "dtrain/nn/linear.h"

namespace {

void expect_attention_close(const at::Tensor& actual, const at::Tensor& expected, const char* what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::allclose(actual, expected, 1e-5, 1e-6))
      << what << ": max abs difference " << (actual - expected).abs().max().item<double>();
}

// Against the fp64 result `exact`: `actual`'s largest error is at most twice
// ATen's fp32 result's (`aten`) plus 1e-7. Measured here: 1.3-1.4x ATen's at
// T = 64 and 256 (about 2e-6 on gradients of N(0, 1) inputs); a wrong mask
// or scale is off by O(1).
void expect_as_accurate(const at::Tensor& actual, const at::Tensor& aten, const at::Tensor& exact, const char* what) {
  const double ours = (actual.to(at::kDouble) - exact).abs().max().item<double>();
  const double theirs = (aten.to(at::kDouble) - exact).abs().max().item<double>();
  EXPECT_LE(ours, 2.0 * theirs + 1e-7) << what << ": error against fp64 " << ours << ", ATen's " << theirs;
}

at::Tensor sdpa_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout = 0.0) {
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout, /*is_causal=*/true);
}

// q, k, v as the GPT makes them: [B, H, T, D] views of one [B, T, 3 H D]
// product, each a leaf's slice so that gradients reach it.
struct Qkv {
  at::Tensor leaf, q, k, v;
};
Qkv qkv_views(const at::Tensor& base, std::int64_t heads) {
  Qkv r;
  r.leaf = base.detach().clone().requires_grad_();
  const auto b = base.size(0), t = base.size(1), c = base.size(2) / 3;
  const auto parts = r.leaf.split(c, 2);
  auto split = [&](const at::Tensor& m) { return m.view({b, t, heads, c / heads}).transpose(1, 2); };
  r.q = split(parts[0]);
  r.k = split(parts[1]);
  r.v = split(parts[2]);
  return r;
}

#define DTRAIN_SKIP_WITHOUT_ONEDNN_ATTENTION()                                                           \
  if (!dtrain::nn::onednn_linear_enabled())                                                              \
  GTEST_SKIP() << "linear() does not take oneDNN here (unavailable, or at::linear chosen for this CPU; " \
                  "unit.onednn.CausalAttention.* runs it with DTRAIN_LINEAR_KERNEL=onednn)"

}  // namespace

TEST(CausalAttention, MatchesScaledDotProductAttentionForwardAndBackward) {
  DTRAIN_SKIP_WITHOUT_ONEDNN_ATTENTION();
  at::manual_seed(0);
  struct Shape {
    std::int64_t b, t, c, heads;
  };
  // One token, odd sizes, nanoGPT's CPU shape, and the longest the path takes.
  const std::vector<Shape> shapes = {
      {1, 1, 24, 1}, {2, 5, 12, 3}, {3, 7, 40, 4}, {12, 64, 128, 4}, {1, dtrain::nn::kMaxOneDnnAttentionLength, 64, 2}};
  for (const auto& s : shapes) {
    SCOPED_TRACE("B " + std::to_string(s.b) + " T " + std::to_string(s.t) + " C " + std::to_string(s.c) + " H " +
                 std::to_string(s.heads));
    const at::Tensor base = at::randn({s.b, s.t, 3 * s.c});
    auto ours = qkv_views(base, s.heads);
    auto ref = qkv_views(base, s.heads);
    EXPECT_TRUE(dtrain::nn::attention_uses_onednn(ours.q, ours.k, ours.v));
    const at::Tensor y = dtrain::nn::causal_attention(ours.q, ours.k, ours.v);
    const at::Tensor y_ref = sdpa_causal(ref.q, ref.k, ref.v);
    expect_attention_close(y, y_ref, "output");
    const at::Tensor dy = at::randn(y.sizes());
    y.backward(dy);
    y_ref.backward(dy);
    // The gradients sum T products per entry in another order than the
    // flash kernel: against fp64 they must be as accurate as ATen's.
    auto exact = qkv_views(base.to(at::kDouble), s.heads);
    const at::Tensor y_exact = sdpa_causal(exact.q, exact.k, exact.v);
    y_exact.backward(dy.to(at::kDouble));
    expect_as_accurate(y, y_ref, y_exact, "output");
    expect_as_accurate(ours.leaf.grad(), ref.leaf.grad(), exact.leaf.grad(), "d qkv");
  }
}

// Each input's gradient alone (autograd computes only what is asked for).
TEST(CausalAttention, GivesEachRequestedGradientAlone) {
  DTRAIN_SKIP_WITHOUT_ONEDNN_ATTENTION();
  at::manual_seed(1);
  const at::Tensor q0 = at::randn({2, 2, 9, 8}), k0 = at::randn({2, 2, 9, 8}), v0 = at::randn({2, 2, 9, 8});
  for (int which = 0; which < 3; ++which) {
    SCOPED_TRACE("input " + std::to_string(which));
    std::vector<at::Tensor> ours{q0.clone(), k0.clone(), v0.clone()}, ref{q0.clone(), k0.clone(), v0.clone()};
    ours[which].requires_grad_();
    ref[which].requires_grad_();
    const at::Tensor y = dtrain::nn::causal_attention(ours[0], ours[1], ours[2]).tanh().sum();
    const at::Tensor y_ref = sdpa_causal(ref[0], ref[1], ref[2]).tanh().sum();
    expect_attention_close(torch::autograd::grad({y}, {ours[which]})[0],
                           torch::autograd::grad({y_ref}, {ref[which]})[0], "gradient");
  }
}

// With create_graph the backward is differentiable: a gradient penalty's
// gradient equals ATen's math attention's (the flash kernel has no double
// backward).
TEST(CausalAttention, SecondDerivativesMatchAtenMathAttention) {
  DTRAIN_SKIP_WITHOUT_ONEDNN_ATTENTION();
  at::manual_seed(2);
  const at::Tensor base = at::randn({2, 6, 3 * 8});
  auto ours = qkv_views(base, 2);
  auto ref = qkv_views(base, 2);
  auto penalty = [](const at::Tensor& y, const at::Tensor& x) {
    const auto g = torch::autograd::grad({y.pow(3).sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    return g[0].pow(2).sum();
  };
  penalty(dtrain::nn::causal_attention(ours.q, ours.k, ours.v), ours.leaf).backward();
  penalty(std::get<0>(at::_scaled_dot_product_attention_math(ref.q, ref.k, ref.v, {}, 0.0, /*is_causal=*/true)),
          ref.leaf)
      .backward();
  expect_attention_close(ours.leaf.grad(), ref.leaf.grad(), "d/dqkv of the penalty");
}

// Dropout, fp64 (with or without CPU autocast), long sequences and keys of
// another length keep ATen's attention: the same bits.
TEST(CausalAttention, IsAtenAttentionWhereOneDnnDoesNotApply) {
  at::manual_seed(3);
  const at::Tensor q = at::randn({1, 2, 5, 4}, at::kDouble);
  EXPECT_FALSE(dtrain::nn::attention_uses_onednn(q, q, q));
  EXPECT_TRUE(at::equal(dtrain::nn::causal_attention(q, q, q), sdpa_causal(q, q, q)));

  const at::Tensor qf = q.to(at::kFloat);
  EXPECT_FALSE(dtrain::nn::attention_uses_onednn(qf, qf, qf, 0.1));
  {
    at::manual_seed(4);
    const at::Tensor dropped = dtrain::nn::causal_attention(qf, qf, qf, 0.1);
    at::manual_seed(4);
    EXPECT_TRUE(at::equal(dropped, sdpa_causal(qf, qf, qf, 0.1)));
  }
  const at::Tensor long_q = at::randn({1, 1, dtrain::nn::kMaxOneDnnAttentionLength + 1, 4});
  EXPECT_FALSE(dtrain::nn::attention_uses_onednn(long_q, long_q, long_q));
  EXPECT_TRUE(at::equal(dtrain::nn::causal_attention(long_q, long_q, long_q), sdpa_causal(long_q, long_q, long_q)));
  const at::Tensor longer_k = at::randn({1, 2, 6, 4});
  EXPECT_FALSE(dtrain::nn::attention_uses_onednn(qf, longer_k, longer_k));

  dtrain::amp::Autocast autocast(at::kCPU);
  EXPECT_FALSE(dtrain::nn::attention_uses_onednn(q, q, q));
  EXPECT_TRUE(at::equal(dtrain::nn::causal_attention(q, q, q), sdpa_causal(q, q, q)));
}

// bf16 q, k, v (a bf16 model's) and fp32 ones under bf16 autocast take the
// oneDNN path (Note [Reduced-precision attention]): the output and its dtype
// as ATen's bf16 attention gives them, and output and gradients as accurate
// as ATen's against fp64 attention on the same bf16 values.
TEST(CausalAttention, Bf16IsAsAccurateAsAtenAttention) {
  DTRAIN_SKIP_WITHOUT_ONEDNN_ATTENTION();
  at::manual_seed(5);
  const at::Tensor base = at::randn({12, 64, 3 * 128});
  for (const bool under_autocast : {true, false}) {
    SCOPED_TRACE(under_autocast ? "fp32 under bf16 autocast" : "bf16 inputs");
    const at::Tensor input = under_autocast ? base : base.to(at::kBFloat16);
    auto ours = qkv_views(input, 4);
    auto ref = qkv_views(input, 4);
    at::Tensor y, y_ref;
    {
      std::optional<dtrain::amp::Autocast> autocast;
      if (under_autocast) autocast.emplace(at::kCPU, dtrain::amp::AutocastOptions{.dtype = at::kBFloat16});
      EXPECT_TRUE(dtrain::nn::attention_uses_onednn(ours.q, ours.k, ours.v));
      y = dtrain::nn::causal_attention(ours.q, ours.k, ours.v);
      y_ref = sdpa_causal(ref.q, ref.k, ref.v);
    }
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    EXPECT_EQ(y_ref.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::allclose(y.to(at::kFloat), y_ref.to(at::kFloat), 2e-2, 2e-2))
        << "max abs difference " << (y.to(at::kFloat) - y_ref.to(at::kFloat)).abs().max().item<double>();
    const at::Tensor dy = at::randn(y.sizes()).to(at::kBFloat16);
    y.backward(dy);
    y_ref.backward(dy);
    auto exact = qkv_views(base.to(at::kBFloat16).to(at::kDouble), 4);
    const at::Tensor y_exact = sdpa_causal(exact.q, exact.k, exact.v);
    y_exact.backward(dy.to(at::kDouble));
    expect_as_accurate(y, y_ref, y_exact, "output");
    expect_as_accurate(ours.leaf.grad(), ref.leaf.grad(), exact.leaf.grad(), "d qkv");
  }
}

// The path follows linear()'s switch: oneDNN exactly where linear() takes it.
TEST(CausalAttention, FollowsTheLinearKernelSwitch) {
  const at::Tensor q = at::randn({1, 2, 5, 4});
  EXPECT_EQ(dtrain::nn::attention_uses_onednn(q, q, q), dtrain::nn::onednn_linear_enabled());
  // What a memory planner is told (examples/gpt/main.cpp) agrees with the path.
  EXPECT_EQ(dtrain::nn::attention_materializes_scores(5), dtrain::nn::attention_uses_onednn(q, q, q));
  EXPECT_FALSE(dtrain::nn::attention_materializes_scores(dtrain::nn::kMaxOneDnnAttentionLength + 1));
}
