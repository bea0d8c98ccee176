// Block attention with log-sum-exp (see block_attention.h): the CPU's flash
// attention kernel where it applies, else math attention from ATen ops.
#include "block_attention.h"

#include <ATen/ATen.h>

#include <limits>

namespace dtrain::nn::cp::detail {

namespace {

bool use_flash(const at::Tensor& q, BlockKernel kernel) {
  return kernel == BlockKernel::kAuto && q.device().is_cpu();
}

// Scores in fp32 with the causal mask applied: [B, H, Lq, Lk].
at::Tensor masked_scores(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  at::Tensor s = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)).mul_(scale);
  if (causal) {
    const at::Tensor above = at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).triu_(1);
    s.masked_fill_(above, -std::numeric_limits<float>::infinity());
  }
  return s;
}

}  // namespace

BlockResult block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                          BlockKernel kernel) {
  if (use_flash(q, kernel)) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, std::nullopt, scale);
    return {out, lse.to(at::kFloat)};
  }
  const at::Tensor s = masked_scores(q, k, causal, scale);
  at::Tensor lse = at::logsumexp(s, -1);
  const at::Tensor p = (s - lse.unsqueeze(-1)).exp_();
  return {at::matmul(p, v.to(at::kFloat)).to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(const at::Tensor& dout, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse, bool causal,
                                                              double scale, BlockKernel kernel) {
  if (use_flash(q, kernel)) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout.contiguous(), q, k, v, out.contiguous(),
                                                                    lse.contiguous(), 0.0, causal, std::nullopt, scale);
  }
  const at::Tensor p = (masked_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp_();  // this block's probabilities
  const at::Tensor dout32 = dout.to(at::kFloat);
  const at::Tensor dv = at::matmul(p.transpose(-2, -1), dout32);
  const at::Tensor dp = at::matmul(dout32, v.to(at::kFloat).transpose(-2, -1));
  const at::Tensor row = (dout32 * out.to(at::kFloat)).sum(-1, /*keepdim=*/true);  // rowsum(dO * O) of the whole row
  const at::Tensor ds = p.mul_(dp - row).mul_(scale);
  const at::Tensor dq = at::matmul(ds, k.to(at::kFloat));
  const at::Tensor dk = at::matmul(ds.transpose(-2, -1), q.to(at::kFloat));
  const auto type = q.scalar_type();
  return {dq.to(type), dk.to(type), dv.to(type)};
}

}  // namespace dtrain::nn::cp::detail
