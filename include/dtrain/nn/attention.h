// dtrain::nn::causal_attention: causal self-attention softmax(q k^T / sqrt(D)
// + mask) v, differentiable, a drop-in for at::scaled_dot_product_attention(q,
// k, v, {}, 0.0, /*is_causal=*/true) that runs the four batched products of a
// short sequence on oneDNN's matmul, as dtrain::nn::linear does the Linears'.
//
// Why: ATen's CPU attention (the flash kernel, and the math path's bmm) does
// its small products on MKL's sgemm, which on AMD EPYC family 26 runs a path
// far below the machine (see linear.h). At nanoGPT's CPU shapes (T = 64,
// D = 32) attention was ~25% of a GPT step there, more than LayerNorm, GELU,
// the loss and the optimizer together (bench/gpt/ops_profile.cpp). This path
// materialises the [B, H, T, T] probabilities (saved for backward), so it is
// taken only for short sequences (kMaxOneDnnAttentionLength); longer ones keep
// the flash kernel, which does not.
//
// Results are those of a different summation order (and of a softmax over the
// whole row rather than flash's running one): equal to ATen's within fp32
// rounding, not bit for bit. bf16 and fp16 inputs (and fp32 ones under CPU
// autocast, cast as autocast casts them for ATen's attention) are computed in
// fp32 on their values and the output rounded to their dtype; what backward
// keeps stays 16-bit (ATen's bf16 flash kernel was ~10x slower here). DTRAIN_LINEAR_KERNEL=aten (linear.h) makes this
// at::scaled_dot_product_attention everywhere, like linear().
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dtrain::nn {

// Sequences longer than this keep ATen's flash kernel: the probabilities this
// path saves grow as T^2 (at T = 256, B x H = 48: 12 MiB per layer).
inline constexpr std::int64_t kMaxOneDnnAttentionLength = 256;

// q, k, v: [B, H, T, D] (any strides) -> [B, H, T, D]; causal (key j > query i
// masked), scale 1/sqrt(D), dropout_p applied to the probabilities as
// at::scaled_dot_product_attention does. Takes the oneDNN path when
// attention_uses_onednn(q, k, v, dropout_p); otherwise returns
// at::scaled_dot_product_attention(q, k, v, {}, dropout_p, true). Gradients
// flow to q, k and v; under create_graph the backward is built from
// differentiable ATen ops, so higher derivatives work.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p = 0.0);

// True when causal_attention() would use oneDNN: onednn_linear_enabled()
// (linear.h), dense CPU q, k, v of one 4-D shape and one dtype (fp32, bf16 or
// fp16) with 1 <= T <= kMaxOneDnnAttentionLength, no dropout.
bool attention_uses_onednn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p = 0.0);

// Whether causal_attention() of CPU sequences of this length, without
// dropout, takes the oneDNN path and so keeps the [B, H, T, T]
// probabilities for backward (a memory planner's "materialized" attention)
// rather than flash's log-sum-exp.
bool attention_materializes_scores(std::int64_t seq_len);

}  // namespace dtrain::nn
