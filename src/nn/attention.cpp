#include "dtrain/nn/attention.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>

#include "dtrain/nn/linear.h"
#include "onednn_matmul.h"

namespace dtrain::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [B, H, T, D] -> contiguous [B * H, T, D].
at::Tensor batched(const at::Tensor& t) {
  return t.reshape({-1, t.size(-2), t.size(-1)}).contiguous();
}

// alpha * a @ b for batched [N, m, k] @ [N, k, n] on oneDNN (each operand's
// matrices row- or column-major: contiguous tensors and their transposes).
at::Tensor onednn_bmm(const at::Tensor& a, const at::Tensor& b, float alpha = 1.0F) {
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  at::native::mkldnn_matmul(a, b, out, /*beta=*/0.0F, alpha);
  return out;
}

// The causal mask of a T x T score matrix, as an addend: -inf above the
// diagonal, 0 elsewhere (adding it is exact; a broadcast add_ is ~10x faster
// than masked_fill_ with a boolean mask on the CPU).
at::Tensor causal_addend(std::int64_t t, const at::TensorOptions& options) {
  return at::full({t, t}, -std::numeric_limits<float>::infinity(), options).triu_(1);
}

// softmax(scale * q k^T + causal mask) from batched q, k; differentiable
// when made of differentiable ops (the create_graph backward uses it so).
at::Tensor probabilities(const at::Tensor& q, const at::Tensor& k, double scale, bool on_onednn) {
  const at::Tensor mask = causal_addend(q.size(1), q.options());
  const at::Tensor s = on_onednn ? onednn_bmm(q, k.transpose(1, 2), static_cast<float>(scale)).add_(mask)
                                 : at::bmm(q, k.transpose(1, 2)) * scale + mask;
  return at::_softmax(s, -1, /*half_to_float=*/false);
}

// Note [oneDNN attention]
// Forward: S = scale q k^T, P = softmax(S + causal mask), O = P v, on batched
// [B * H, T, *] operands (causal_attention() copies q, k, v so, outside
// this Function: their [B, H, T, D] views out of the fused qkv product have no
// single batch stride; autograd carries the gradients back through the copy,
// and the copies, saved here, replace the qkv product's output, which nothing
// else keeps). Saves q, k, v and P.
// Backward (the softmax's Jacobian applied row by row):
//   dV = P^T dO,  dP = dO v^T,  dS = P * (dP - rowsum(dP * P)),
//   dQ = scale dS k,  dK = scale dS^T q.
// Masked entries have P = 0, so dS is 0 there with no mask of its own.
//
// Note [Reduced-precision attention]
// bf16 or fp16 q, k, v (a bf16 model, or autocast's casts): the products and
// the softmax run in fp32 on the inputs' values (upcast, exact), and the output
// is rounded to the inputs' dtype, as ATen's CPU flash kernel accumulates in
// fp32 and rounds its output. What is saved stays in the inputs' dtype (q, k,
// v as given, P rounded like flash rounds it for its value products), so the
// memory is that of a 16-bit activation; backward upcasts it. ATen's flash
// kernel in bf16 was ~10x slower than this path in a GPT step here (45 of a
// ~100 ms profiled step, issue 29).
struct OneDnnCausalAttention : torch::autograd::Function<OneDnnCausalAttention> {
  // q, k, v: contiguous [B * H, T, D] of one floating dtype -> [B * H, T, D]
  // of that dtype.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    // A custom Function's forward is no op of its own: named for profilers.
    RECORD_FUNCTION("dtrain::nn::causal_attention", std::vector<c10::IValue>());
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const at::Tensor p = probabilities(q.to(at::kFloat), k.to(at::kFloat), scale, /*on_onednn=*/true);
    ctx->save_for_backward({q, k, v, p.to(q.scalar_type())});
    ctx->saved_data["scale"] = scale;
    return onednn_bmm(p, v.to(at::kFloat)).to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto dtype = saved[0].scalar_type();
    const at::Tensor q = saved[0].to(at::kFloat), k = saved[1].to(at::kFloat), v = saved[2].to(at::kFloat);
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor dout = grads[0].to(at::kFloat).contiguous();
    if (at::GradMode::is_enabled()) {
      // create_graph: the same gradients from ops autograd can differentiate,
      // P recomputed from the saved inputs so that it carries their graph.
      const at::Tensor p = probabilities(q, k, scale, /*on_onednn=*/false);
      const at::Tensor dp = at::bmm(dout, v.transpose(1, 2));
      const at::Tensor ds = p * (dp - (dp * p).sum(-1, /*keepdim=*/true));
      return {(at::bmm(ds, k) * scale).to(dtype), (at::bmm(ds.transpose(1, 2), q) * scale).to(dtype),
              at::bmm(p.transpose(1, 2), dout).to(dtype)};
    }
    const at::Tensor p = saved[3].to(at::kFloat);
    const at::Tensor dp = onednn_bmm(dout, v.transpose(1, 2));
    const at::Tensor ds = at::_softmax_backward_data(dp, p, -1, at::kFloat);
    at::Tensor dq, dk, dv;
    if (ctx->needs_input_grad(0)) dq = onednn_bmm(ds, k, static_cast<float>(scale)).to(dtype);
    if (ctx->needs_input_grad(1)) dk = onednn_bmm(ds.transpose(1, 2), q, static_cast<float>(scale)).to(dtype);
    if (ctx->needs_input_grad(2)) dv = onednn_bmm(p.transpose(1, 2), dout).to(dtype);
    return {dq, dk, dv};
  }
};

// The dtype ATen's attention would compute in: under CPU autocast its
// lower-precision dtype (scaled_dot_product_attention is on autocast's
// lower-precision list), else the inputs'.
c10::ScalarType compute_dtype(const at::Tensor& q) {
  return at::autocast::is_autocast_enabled(at::kCPU) ? at::autocast::get_autocast_dtype(at::kCPU) : q.scalar_type();
}

bool is_attention_dtype(c10::ScalarType d) {
  return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf;
}

bool is_dense_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided;
}

}  // namespace

bool attention_uses_onednn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p) {
  return onednn_linear_enabled() && dropout_p == 0.0 && q.dim() == 4 && q.sizes() == k.sizes() &&
         q.sizes() == v.sizes() && q.size(2) >= 1 && q.size(2) <= kMaxOneDnnAttentionLength && q.numel() > 0 &&
         is_dense_cpu(q) && is_dense_cpu(k) && is_dense_cpu(v) && is_attention_dtype(q.scalar_type()) &&
         k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
         is_attention_dtype(compute_dtype(q));
}

bool attention_materializes_scores(std::int64_t seq_len) {
  return onednn_linear_enabled() && seq_len >= 1 && seq_len <= kMaxOneDnnAttentionLength;
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p) {
  if (!attention_uses_onednn(q, k, v, dropout_p)) {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout_p, /*is_causal=*/true);
  }
  // Under autocast: its cast of the inputs (Note [Reduced-precision
  // attention]), then no autocast inside (the Function's ops pick their own
  // dtypes).
  const auto dtype = compute_dtype(q);
  auto in = [&](const at::Tensor& t) { return batched(t.to(dtype)); };
  const at::Tensor bq = in(q), bk = in(k), bv = in(v);
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  return OneDnnCausalAttention::apply(bq, bk, bv).view(q.sizes());
}

}  // namespace dtrain::nn
