// Block attention with log-sum-exp (see block_attention.h): the CPU's flash
// attention kernel on CPU tensors, the memory-efficient kernel on CUDA
// tensors where it applies, else math attention from ATen ops.
#include "block_attention.h"

#include <ATen/ATen.h>

#include <limits>

namespace dtrain::nn::cp::detail {

namespace {

bool use_flash(const at::Tensor& q, BlockKernel kernel) {
  return kernel == BlockKernel::kAuto && q.device().is_cpu();
}

// Note [CUDA block kernel]
// On CUDA the blocks run on ATen's memory-efficient attention
// (_scaled_dot_product_efficient_attention with compute_log_sumexp, and its
// backward), the one fused CUDA kernel that returns the log-sum-exp for
// fp32 as well as fp16/bf16. Its conditions, checked here so that anything
// else takes the math path instead of failing inside the kernel: fp32 q, k,
// v (see below), a head dimension that is a multiple of 8 (its alignment).
// Its causal mask is top-left aligned, as block_attention.h asks. Its log-sum-exp comes padded
// along the queries to a multiple of 32; the merge wants [B, H, Lq], and its
// backward reads the padded layout, so the merged rows go back into a
// +inf-padded buffer of that length (padding rows are never read as
// queries). Dropout is 0, so the philox seed and offset it takes are unused.
//
// fp32 only for now: on an H100 with torch 2.11 (docs/gpu.md, 2026-11-24)
// the bf16 blocks' output and dv matched unsplit fp64 attention but dq and
// dk were off by up to 5.8 and 7.0 (GpuContextParallel.*), while fp32 on
// the same kernel and bf16 on the math path matched. Until that is
// understood, fp16/bf16 blocks on CUDA take the math path, which is exact.
bool use_efficient_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, BlockKernel kernel) {
  if (kernel != BlockKernel::kAuto || !q.is_cuda()) return false;
  const auto type = q.scalar_type();
  return type == at::kFloat && k.scalar_type() == type && v.scalar_type() == type && q.size(-1) % 8 == 0 &&
         v.size(-1) % 8 == 0;
}

std::int64_t padded_queries(std::int64_t lq) {
  return (lq + 31) / 32 * 32;
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
                          BlockKernel kernel, const at::Tensor& dropout) {
  if (dropout.defined()) kernel = BlockKernel::kMath;
  if (use_flash(q, kernel)) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, std::nullopt, scale);
    return {out, lse.to(at::kFloat)};
  }
  if (use_efficient_cuda(q, k, v, kernel)) {  // Note [CUDA block kernel]
    auto [out, lse, seed, offset] = at::_scaled_dot_product_efficient_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), std::nullopt, /*compute_log_sumexp=*/true, 0.0, causal, scale);
    return {out, lse.narrow(-1, 0, q.size(-2)).to(at::kFloat)};
  }
  const at::Tensor s = masked_scores(q, k, causal, scale);
  at::Tensor lse = at::logsumexp(s, -1);
  at::Tensor p = (s - lse.unsqueeze(-1)).exp_();
  if (dropout.defined()) p.mul_(dropout.to(at::kFloat));
  return {at::matmul(p, v.to(at::kFloat)).to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(const at::Tensor& dout, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse, bool causal,
                                                              double scale, BlockKernel kernel,
                                                              const at::Tensor& dropout) {
  if (dropout.defined()) kernel = BlockKernel::kMath;
  if (use_flash(q, kernel)) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout.contiguous(), q, k, v, out.contiguous(),
                                                                    lse.contiguous(), 0.0, causal, std::nullopt, scale);
  }
  if (use_efficient_cuda(q, k, v, kernel)) {  // Note [CUDA block kernel]
    const std::int64_t lq = q.size(-2);
    at::Tensor padded = at::full({lse.size(0), lse.size(1), padded_queries(lq)}, std::numeric_limits<float>::infinity(),
                                 lse.options().dtype(at::kFloat));
    padded.narrow(-1, 0, lq).copy_(lse);
    const at::Tensor unused = at::empty({0}, at::TensorOptions().dtype(at::kLong));
    auto [dq, dk, dv, dbias] = at::_scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), at::Tensor(), out.contiguous(), padded,
        unused, unused, 0.0, {true, true, true, false}, causal, scale);
    return {dq, dk, dv};
  }
  const at::Tensor p = (masked_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp_();  // this block's probabilities
  const at::Tensor dout32 = dout.to(at::kFloat);
  const at::Tensor z = dropout.defined() ? dropout.to(at::kFloat) : at::Tensor();
  const at::Tensor dv = at::matmul((z.defined() ? p * z : p).transpose(-2, -1), dout32);
  at::Tensor dp = at::matmul(dout32, v.to(at::kFloat).transpose(-2, -1));
  if (z.defined()) dp.mul_(z);
  const at::Tensor row = (dout32 * out.to(at::kFloat)).sum(-1, /*keepdim=*/true);  // rowsum(dO * O) of the whole row
  const at::Tensor ds = p.mul_(dp - row).mul_(scale);
  const at::Tensor dq = at::matmul(ds, k.to(at::kFloat));
  const at::Tensor dk = at::matmul(ds.transpose(-2, -1), q.to(at::kFloat));
  const auto type = q.scalar_type();
  return {dq.to(type), dk.to(type), dv.to(type)};
}

}  // namespace dtrain::nn::cp::detail
